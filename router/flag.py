"""One setting as the command line, the environment and a TOML file see it (`Flag`), and the
groups `kvbaton serve --help=GROUP` and docs/configuration.md show the flags in."""

from __future__ import annotations

import enum
from dataclasses import dataclass

ENV_PREFIX = "KVBATON_"


class Group(enum.Enum):
    """A heading of the help; its value is what `--help=GROUP` takes."""

    ENGINES = "engines"
    SERVER = "server"
    SESSIONS = "sessions"
    REUSE = "reuse"
    KV_EVENTS = "kv-events"
    PINS = "pins"
    LIMITS = "limits"
    SECURITY = "security"
    OBSERVABILITY = "observability"

    @property
    def about(self) -> str:
        """What the group's flags are about, in a line."""
        return _ABOUT[self]

    @property
    def title(self) -> str:
        """The group's heading in --help and docs/configuration.md."""
        return f"{self.value}: {self.about}"


_ABOUT = {
    Group.ENGINES: "the P and D instances, their connector and how they are probed",
    Group.SERVER: "where the router listens and with how many processes",
    Group.SESSIONS: "where conversations are stored and for how long",
    Group.REUSE: "when a turn reads KV from the previous D, and where a turn runs",
    Group.KV_EVENTS: "placement by what each engine already holds",
    Group.PINS: "releasing the handles on a D that nobody will read",
    Group.LIMITS: "timeouts for engines and clients, body size, ejection",
    Group.SECURITY: "the admin API's keys and session signing",
    Group.OBSERVABILITY: "logs and traces",
}


# The groups of `--help=GROUP` and docs/configuration.md, each flag in one (a test says so).
GROUPS: dict[Group, tuple[str, ...]] = {
    Group.ENGINES: (
        "prefill",
        "decode",
        "kv_connector",
        "model",
        "engine_api_key",
        "check_models",
        "resolve_dns",
        "data_parallel_size",
        "prefill_coordinates",
        "moriio_register",
        "moriio_register_ttl",
        "block_size",
        "stream_kv_params",
    ),
    Group.SERVER: ("host", "port", "workers", "event_loop", "shutdown_grace"),
    Group.SESSIONS: (
        "redis_url",
        "session_store",
        "session_ttl",
        "handle_ttl",
        "history_sessions",
        "response_ttl",
        "response_max_bytes",
        "tenant_header",
        "store_timeout",
        "store_retry_after",
    ),
    Group.REUSE: (
        "reuse",
        "verify_prefix",
        "min_reuse_tokens",
        "decode_local_max_tokens",
        "decode_local_max_inflight",
        "prefill_token_ids",
        "first_token_seeding",
        "concurrent_dispatch",
    ),
    Group.KV_EVENTS: ("kv_events", "kv_events_port", "kv_events_topic", "kv_index_max_blocks"),
    Group.PINS: ("release_pins", "release_after", "pin_high_water", "pin_low_water"),
    Group.LIMITS: (
        "connect_timeout",
        "prefill_timeout",
        "decode_first_byte_timeout",
        "decode_idle_timeout",
        "max_body_bytes",
        "header_timeout",
        "body_timeout",
        "unhealthy_after",
        "health_interval",
    ),
    Group.SECURITY: ("session_secret", "unsigned_sessions", "admin_key", "admin_api_key"),
    Group.OBSERVABILITY: ("log_level", "log_format", "otel_endpoint"),
}

# What `kvbaton serve --help` shows before naming the groups: what a first router needs.
FIRST = ("prefill", "decode", "host", "port", "redis_url", "session_store", "session_secret")


def cli_name(name: str) -> str:
    """A setting's flag: `redis_url` is `--redis-url`."""
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """A setting's variable: `redis_url` is `KVBATON_REDIS_URL`."""
    return ENV_PREFIX + name.upper()


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
    # A list flag given once per value (--kv-events A --kv-events B); its values may hold
    # commas, so the environment separates them by spaces only.
    repeat: bool = False
    # What the flag takes, as --help and docs/configuration.md show it (empty: by its type).
    metavar: str = ""
    # Needed to start (unless instances announce themselves: --moriio-register).
    required: bool = False


def placeholder(flag: Flag) -> str:
    """The value a flag takes as help shows it: by default an int is N, a float SECONDS."""
    return flag.metavar or {int: "N", float: "SECONDS"}.get(flag.kind, "VALUE")
