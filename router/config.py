"""Settings: one frozen struct (declared in settings.py), built in one place from the command
line, env and a TOML file.

No other module reads `os.environ`. Every flag `--some-flag` is also `KVBATON_SOME_FLAG`.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from router import command_line
from router.engines import ranks
from router.errors import ConfigError
from router.flag import ENV_PREFIX, Flag, cli_name, declared, env_name
from router.settings import FLAGS, Settings

# ENV_PREFIX and Flag live in flag.py, Settings and FLAGS in settings.py; this module's too.
__all__ = [
    "ENV_PREFIX",
    "FLAGS",
    "WORKER_ENV",
    "Flag",
    "Settings",
    "WorkerSlot",
    "base_url",
    "build_parser",
    "load_settings",
    "validate",
    "worker_slot",
]


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def build_parser(
    prog: str = "kvbaton serve", settings_type: type[Settings] = Settings
) -> argparse.ArgumentParser:
    """The `kvbaton serve` command line, its help showing each flag's default."""
    return command_line.build_parser(settings_type(prefill=(), decode=()), prog)


def _from_env(env: Mapping[str, str], flags: tuple[Flag, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for flag in flags:
        source = env_name(flag.name)
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
            text = raw if flag.repeat or not isinstance(raw, str) else raw.replace(",", " ")
            items = text.split() if isinstance(text, str) else list(text)
            return tuple(str(item) for item in items)
        if flag.kind is bool:
            return raw if isinstance(raw, bool) else _parse_bool(str(raw))
        value = flag.kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"{source}: {value!r} is not one of {', '.join(flag.choices)}")
    return value


def _from_file(path: str, flags: tuple[Flag, ...]) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    known = {flag.name: flag for flag in flags}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        values[name] = _convert(known[name], raw, source=f"{path}: {key}")
    return values


def load_settings(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    settings_type: type[Settings] = Settings,
) -> Settings:
    """Settings from (lowest to highest precedence) defaults, file, env, command line; every
    flag, variable and key is a field of `settings_type`."""
    env = os.environ if env is None else env
    flags = declared(settings_type)
    args = command_line.parse(build_parser(settings_type=settings_type), argv)
    config_file = args.pop("config") or env.get(ENV_PREFIX + "CONFIG")
    values: dict[str, Any] = _from_file(config_file, flags) if config_file else {}
    values.update(_from_env(env, flags))
    for flag in flags:
        if args.get(flag.name) is not None:
            values[flag.name] = _convert(flag, args[flag.name], source=cli_name(flag.name))
    return validate(values, settings_type)


def base_url(raw: str) -> str:
    """An instance URL without its trailing slash; a bare `host:port` (as the demo proxies
    take it) is `http://host:port`."""
    url = raw.strip().rstrip("/")
    return url if "://" in url or not url else "http://" + url


def validate(values: Mapping[str, Any], settings_type: type[Settings] = Settings) -> Settings:
    data = dict(values)
    data.setdefault("prefill", ())
    data.setdefault("decode", ())
    for role in ("prefill", "decode"):
        urls = tuple(base_url(url) for url in data[role])
        if not urls and not data.get("moriio_register"):  # else: instances announce themselves
            raise ConfigError(f"at least one --{role} URL is required")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--{role} {url!r}: expected an http:// or https:// URL")
        data[role] = urls
    try:
        settings = msgspec.convert(data, settings_type)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    _check(settings)
    return settings


def _check_moriio(settings: Settings) -> None:
    # Which connector takes registrations is the connector's to say (connectors/select.py).
    if settings.moriio_register and settings.workers > 1:
        raise ConfigError("--moriio-register binds one socket: it needs --workers 1")
    if settings.moriio_register_ttl <= 0:
        raise ConfigError("--moriio-register-ttl must be > 0")


def _check(settings: Settings) -> None:
    """What msgspec's types cannot say about the settings together."""
    if settings.handle_ttl <= 0 or settings.session_ttl < settings.handle_ttl:
        raise ConfigError("--handle-ttl must be > 0 and not above --session-ttl")
    local = (settings.decode_local_max_tokens, settings.decode_local_idle_inflight)
    if min(settings.block_size, settings.min_reuse_tokens, *local) < 0:
        raise ConfigError(
            "--block-size, --min-reuse-tokens, --decode-local-max-tokens, "
            "--decode-local-idle-inflight: >= 0"
        )
    if settings.release_after < 0 or not (
        0 < settings.pin_low_water <= settings.pin_high_water <= 1
    ):
        raise ConfigError(
            "--release-after must be >= 0 and 0 < --pin-low-water <= --pin-high-water <= 1"
        )
    if settings.response_ttl < 0 or settings.response_max_bytes < 1:
        raise ConfigError("--response-ttl must be >= 0 and --response-max-bytes >= 1")
    if settings.decode_local_max_inflight < 1:
        raise ConfigError("--decode-local-max-inflight must be >= 1")
    if any(len(s) < 16 for s in settings.session_secrets):
        raise ConfigError("--session-secret: each secret needs at least 16 characters")
    if settings.session_secrets and settings.unsigned_sessions:
        raise ConfigError("--session-secret and --unsigned-sessions: choose one")
    _check_kv_events(settings)
    _check_coordinates(settings)
    _check_moriio(settings)
    if settings.workers < 1 or min(settings.header_timeout, settings.body_timeout) <= 0:
        raise ConfigError("--workers must be >= 1, --header-timeout and --body-timeout > 0")
    if settings.workers > 1 and settings.session_store == "memory":
        raise ConfigError(
            "--workers above 1 needs --session-store redis: a memory store lives in one "
            "process, so the workers would not see each other's conversations"
        )


def _check_kv_events(settings: Settings) -> None:
    if settings.kv_events_port < 0 or settings.kv_index_max_blocks < 1:
        raise ConfigError("--kv-events-port must be >= 0 and --kv-index-max-blocks >= 1")
    for spec in settings.kv_events:
        if "=" not in spec or not spec.partition("=")[2].startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--kv-events {spec!r}: expected URL=tcp://HOST:PORT[,REPLAY]")


def _check_coordinates(settings: Settings) -> None:
    for spec in settings.data_parallel_size:
        try:
            ranks.parse_spec(spec)
        except ValueError as exc:
            raise ConfigError(f"--data-parallel-size {exc}") from None


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
