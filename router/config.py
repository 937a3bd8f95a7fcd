"""Settings: one frozen struct, built in one place from the command line, env and a TOML file.

No other module reads `os.environ`. Every flag `--some-flag` is also `KVBATON_SOME_FLAG`.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

ENV_PREFIX = "KVBATON_"


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the router is configured with. Building it does no work."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"
    session_store: Literal["redis", "memory"] = "redis"
    handle_ttl: float = 450.0
    session_ttl: float = 3600.0
    reuse: bool = True
    verify_prefix: Literal["tokens", "digest"] = "tokens"
    block_size: int = 0
    min_reuse_tokens: int = 0
    stream_kv_params: bool = False
    prefill_token_ids: bool = True
    engine_api_key: str = ""
    tenant_header: str = ""
    admin_key: str = ""
    admin_api_key: str = ""
    model: str = ""
    connect_timeout: float = 2.0
    prefill_timeout: float = 120.0
    decode_first_byte_timeout: float = 120.0
    decode_idle_timeout: float = 60.0
    store_timeout: float = 0.25
    store_retry_after: float = 2.0
    max_body_bytes: int = 16 * 1024 * 1024
    unhealthy_after: int = 3
    health_interval: float = 5.0
    resolve_dns: bool = False
    shutdown_grace: float = 30.0
    check_models: bool = True
    log_level: str = "info"
    log_format: Literal["text", "json"] = "text"
    otel_endpoint: str = ""


@dataclass(frozen=True)
class Flag:
    """One setting as the command line, env and file see it."""

    name: str
    help: str
    kind: type = str
    many: bool = False
    choices: tuple[str, ...] = ()
    # Another variable read when KVBATON_<FLAG> is unset (a convention other proxies use).
    env_alias: str = ""


FLAGS: tuple[Flag, ...] = (
    Flag(
        "prefill",
        "prefill (P) instance base URLs (a bare host:port means http://host:port)",
        many=True,
    ),
    Flag(
        "decode",
        "decode (D) instance base URLs (a bare host:port means http://host:port)",
        many=True,
    ),
    Flag("host", "address to listen on"),
    Flag("port", "port to listen on", int),
    Flag(
        "workers",
        "router processes sharing the listening socket, each with its own event loop and "
        "engine connections (more than 1 needs the redis session store)",
        int,
    ),
    Flag("redis_url", "Redis URL for session state"),
    Flag(
        "session_store",
        "where sessions live ('memory': one replica, no Redis)",
        choices=("redis", "memory"),
    ),
    Flag(
        "handle_ttl",
        "seconds a captured D handle stays usable; keep it below D's "
        "decoder_kv_blocks_ttl (480 s by default)",
        float,
    ),
    Flag("session_ttl", "seconds a conversation's affinity and digests are kept", float),
    Flag("reuse", "send the previous D's handle to P (--no-reuse keeps affinity only)", bool),
    Flag(
        "verify_prefix",
        "how a new prompt is checked against the KV D holds before a read",
        choices=("tokens", "digest"),
    ),
    Flag("block_size", "engine KV block size in tokens (0: read vllm:cache_config_info)", int),
    Flag("min_reuse_tokens", "smallest verified prefix worth a D->P pull (0: one block)", int),
    Flag(
        "stream_kv_params",
        "the decode engines stream kv_transfer_params in the final SSE chunk (vLLM PR #40186)",
        bool,
    ),
    Flag(
        "prefill_token_ids",
        "on a hit verified by P's /tokenize, send P those token ids on /v1/completions "
        "instead of the chat body: P does not render and tokenize the conversation again",
        bool,
    ),
    Flag("engine_api_key", "Bearer key sent to the engines (vLLM --api-key)"),
    Flag("tenant_header", "header whose value scopes conversations (default: the bearer token)"),
    Flag("admin_key", "Bearer key for /admin/ (empty: admin API disabled)"),
    Flag(
        "admin_api_key",
        "X-API-Key for POST /instances/add, the demo proxies' convention (empty: --admin-key; "
        "both empty: the route is disabled)",
        env_alias="ADMIN_API_KEY",
    ),
    Flag("model", "served model name the engines must report (empty: take the engines')"),
    Flag("connect_timeout", "seconds to connect to an engine", float),
    Flag("prefill_timeout", "seconds for a whole prefill request", float),
    Flag("decode_first_byte_timeout", "seconds until the decode engine's response starts", float),
    Flag("decode_idle_timeout", "seconds a decode stream may stay silent", float),
    Flag("store_timeout", "seconds per session-store call before it counts as down", float),
    Flag("store_retry_after", "seconds to route without the store after it failed", float),
    Flag("max_body_bytes", "largest accepted request body", int),
    Flag("unhealthy_after", "consecutive failures that eject an instance", int),
    Flag(
        "health_interval",
        "seconds between health probes of ejected instances, reads of each decode instance's "
        "process start time (a restart makes its handles unusable), and re-reads of the admin "
        "API's instance registry",
        float,
    ),
    Flag(
        "resolve_dns",
        "expand each --prefill/--decode host name to one instance per address it resolves to "
        "(a Kubernetes headless Service), re-resolved every --health-interval: new addresses "
        "join, vanished ones drain",
        bool,
    ),
    Flag("shutdown_grace", "seconds in-flight requests get to finish on shutdown", float),
    Flag("check_models", "check every instance's /v1/models at start", bool),
    Flag("log_level", "log level", choices=("debug", "info", "warning", "error")),
    Flag("log_format", "log lines as plain text or one JSON object each", choices=("text", "json")),
    Flag(
        "otel_endpoint",
        "OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces (empty: no tracing; "
        "needs the 'otel' extra)",
    ),
)


class ConfigError(ValueError):
    """The configuration is invalid; the message says which setting and why."""


def _cli_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def build_parser(prog: str = "kvbaton serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Route multi-turn conversations over vLLM prefill/decode instances, "
        "reusing each conversation's KV cache from the previous decode node. Every flag is "
        "also read from the environment as KVBATON_<FLAG> (e.g. KVBATON_REDIS_URL).",
    )
    parser.add_argument("--config", help="TOML file with settings (keys as flag names)")
    defaults = Settings(prefill=(), decode=())
    for flag in FLAGS:
        default = getattr(defaults, flag.name)
        shown = f" (default: {default})" if not flag.many else ""
        help_text = f"{flag.help}{shown} [env {_env_name(flag.name)}]"
        if flag.kind is bool:
            parser.add_argument(
                _cli_name(flag.name),
                dest=flag.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        elif flag.many:
            parser.add_argument(
                _cli_name(flag.name),
                dest=flag.name,
                nargs="+",
                default=None,
                metavar="URL",
                help=help_text,
            )
        else:
            parser.add_argument(
                _cli_name(flag.name),
                dest=flag.name,
                default=None,
                type=flag.kind,
                choices=flag.choices or None,
                help=help_text,
            )
    return parser


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for flag in FLAGS:
        source = _env_name(flag.name)
        raw = env.get(source)
        if raw is None and flag.env_alias:
            source, raw = flag.env_alias, env.get(flag.env_alias)
        if raw is None:
            continue
        values[flag.name] = _convert(flag, raw, source=source)
    return values


def _convert(flag: Flag, raw: Any, *, source: str) -> Any:
    try:
        if flag.many:
            items = raw.replace(",", " ").split() if isinstance(raw, str) else list(raw)
            return tuple(str(item) for item in items)
        if flag.kind is bool:
            return raw if isinstance(raw, bool) else _parse_bool(str(raw))
        value = flag.kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"{source}: {value!r} is not one of {', '.join(flag.choices)}")
    return value


def _from_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    known = {flag.name: flag for flag in FLAGS}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        values[name] = _convert(known[name], raw, source=f"{path}: {key}")
    return values


def load_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> Settings:
    """Settings from (lowest to highest precedence) defaults, file, env, command line."""
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(list(argv)))
    config_file = args.pop("config") or env.get(ENV_PREFIX + "CONFIG")
    values: dict[str, Any] = _from_file(config_file) if config_file else {}
    values.update(_from_env(env))
    for flag in FLAGS:
        if args.get(flag.name) is not None:
            values[flag.name] = _convert(flag, args[flag.name], source=_cli_name(flag.name))
    return validate(values)


def base_url(raw: str) -> str:
    """An instance URL without its trailing slash; a bare `host:port` (as the demo proxies
    take it) is `http://host:port`."""
    url = raw.strip().rstrip("/")
    return url if "://" in url or not url else "http://" + url


def validate(values: Mapping[str, Any]) -> Settings:
    data = dict(values)
    data.setdefault("prefill", ())
    data.setdefault("decode", ())
    for role in ("prefill", "decode"):
        urls = tuple(base_url(url) for url in data[role])
        if not urls:
            raise ConfigError(f"at least one --{role} URL is required")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--{role} {url!r}: expected an http:// or https:// URL")
        data[role] = urls
    try:
        settings = msgspec.convert(data, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    if settings.handle_ttl <= 0 or settings.session_ttl < settings.handle_ttl:
        raise ConfigError("--handle-ttl must be > 0 and not above --session-ttl")
    if settings.block_size < 0 or settings.min_reuse_tokens < 0:
        raise ConfigError("--block-size and --min-reuse-tokens must be >= 0")
    if settings.workers < 1:
        raise ConfigError("--workers must be >= 1")
    if settings.workers > 1 and settings.session_store == "memory":
        raise ConfigError(
            "--workers above 1 needs --session-store redis: a memory store lives in one "
            "process, so the workers would not see each other's conversations"
        )
    return settings


# Set by `kvbaton serve --workers N` in each worker's environment (not a setting):
# "<index>,<listening socket fd>,<readiness pipe fd>".
WORKER_ENV = "KVBATON_WORKER_SLOT"


@dataclass(frozen=True)
class WorkerSlot:
    """What a worker process inherits from its supervisor."""

    index: int
    listen_fd: int
    ready_fd: int

    def encode(self) -> str:
        return f"{self.index},{self.listen_fd},{self.ready_fd}"


def worker_slot(env: Mapping[str, str] | None = None) -> WorkerSlot | None:
    """This process's slot when a supervisor started it, else None."""
    raw = (os.environ if env is None else env).get(WORKER_ENV)
    if not raw:
        return None
    try:
        index, listen_fd, ready_fd = (int(part) for part in raw.split(","))
    except ValueError:
        raise ConfigError(f"{WORKER_ENV}: expected three integers, got {raw!r}") from None
    return WorkerSlot(index, listen_fd, ready_fd)
