"""`Settings`: every setting `kvbaton serve` takes, each declared once, as a field: its type,
its default, its `Flag` (help group, placeholder) and, below it, its help. The command line, the
environment, the TOML file and docs/configuration.md are all built from these fields."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from router.connectors.names import ConnectorName
from router.flag import Flag, Group, declared


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the router is configured with. Building it does no work.

    A new setting is a field here and nothing else: `router.flag.declared` reads the fields,
    in the order of their groups, as --help and docs/configuration.md list them."""

    prefill: Annotated[
        tuple[str, ...], Flag(Group.ENGINES, metavar="URL", required=True, first=True)
    ]
    """prefill (P) instance base URLs (a bare host:port means http://host:port); none needed
    with --moriio-register"""
    decode: Annotated[
        tuple[str, ...], Flag(Group.ENGINES, metavar="URL", required=True, first=True)
    ]
    """decode (D) instance base URLs (a bare host:port means http://host:port); none needed with
    --moriio-register"""
    kv_connector: Annotated[ConnectorName, Flag(Group.ENGINES)] = ConnectorName.NIXL
    """the engines' KV-transfer protocol (nixl: NixlConnector pull, with D->P reuse; nixl-push:
    NixlPushConnector, P and D called concurrently, affinity only; store: KV through a shared
    store such as MooncakeStoreConnector, no kv_transfer_params; moriio: MoRIIOConnector, READ
    or WRITE as the instances announce, affinity only)"""
    model: Annotated[str, Flag(Group.ENGINES, metavar="NAME")] = ""
    """served model name the engines must report (empty: take the engines')"""
    engine_api_key: Annotated[str, Flag(Group.ENGINES, metavar="KEY")] = ""
    """Bearer key sent to the engines (vLLM --api-key)"""
    check_models: Annotated[bool, Flag(Group.ENGINES)] = True
    """check every instance's /v1/models at start"""
    resolve_dns: Annotated[bool, Flag(Group.ENGINES)] = False
    """expand each --prefill/--decode host name to one instance per address it resolves to (a
    Kubernetes headless Service), re-resolved every --health-interval: new addresses join,
    vanished ones drain"""
    data_parallel_size: Annotated[
        tuple[str, ...], Flag(Group.ENGINES, metavar="URL=N", repeat=True)
    ] = ()
    """an engine's internal data-parallel size (vllm serve --data-parallel-size), once per
    engine: each conversation stays on one rank (X-data-parallel-rank), new ones are spread over
    the ranks"""
    prefill_coordinates: Annotated[
        tuple[str, ...],
        Flag(Group.ENGINES, metavar="URL=ENGINE_ID@SIDE_HOST:SIDE_PORT[,tp=N][,pp=N]", repeat=True),
    ] = ()
    """nixl-push: a P instance's side-channel coordinates, once per P (a P not named is probed
    for them), e.g. http://10.0.0.1:8100=prefill-0@10.0.0.1:5600"""
    moriio_register: Annotated[str, Flag(Group.ENGINES, metavar="tcp://HOST:PORT")] = ""
    """a ZMQ endpoint (tcp://HOST:PORT) the router binds for MoRI-IO instances' announcements
    (vLLM's toy proxy binds tcp://0.0.0.0:36367); empty: none"""
    moriio_register_ttl: Annotated[float, Flag(Group.ENGINES)] = 30.0
    """seconds after its last announcement that a MoRI-IO instance is dropped"""
    block_size: Annotated[int, Flag(Group.ENGINES, metavar="TOKENS")] = 0
    """engine KV block size in tokens (0: read vllm:cache_config_info)"""
    stream_kv_params: Annotated[bool, Flag(Group.ENGINES)] = False
    """the decode engines stream kv_transfer_params in the final SSE chunk (vLLM PR #40186),
    from the first turn; not needed for vLLM 0.33, whose `/version` says so"""

    host: Annotated[str, Flag(Group.SERVER, metavar="HOST", first=True)] = "127.0.0.1"
    """address to listen on"""
    port: Annotated[int, Flag(Group.SERVER, metavar="PORT", first=True)] = 8000
    """port to listen on"""
    workers: Annotated[int, Flag(Group.SERVER)] = 1
    """router processes sharing the listening socket, each with its own event loop and engine
    connections (more than 1 needs the redis session store)"""
    event_loop: Annotated[Literal["uvloop", "asyncio"], Flag(Group.SERVER)] = "uvloop"
    """each process's event loop: 'uvloop' (libuv, as Hypercorn's uvloop worker class) or the
    standard library's 'asyncio' (docs/operations.md, *Event loop*, has the last figures)"""
    shutdown_grace: Annotated[float, Flag(Group.SERVER)] = 30.0
    """seconds in-flight requests get to finish on shutdown"""

    redis_url: Annotated[str, Flag(Group.SESSIONS, metavar="URL", first=True)] = (
        "redis://127.0.0.1:6379/0"
    )
    """Redis URL for session state"""
    session_store: Annotated[Literal["redis", "memory"], Flag(Group.SESSIONS, first=True)] = "redis"
    """where sessions live ('memory': one replica, no Redis)"""
    session_ttl: Annotated[float, Flag(Group.SESSIONS)] = 3600.0
    """seconds a conversation's affinity and digests are kept"""
    handle_ttl: Annotated[float, Flag(Group.SESSIONS)] = 450.0
    """seconds a captured D handle stays usable; keep it below D's decoder_kv_blocks_ttl (480 s
    by default)"""
    history_sessions: Annotated[bool, Flag(Group.SESSIONS)] = True
    """find the session of a request without a conversation id by its history (a tenant-scoped
    digest of the conversation a D holds)"""
    response_ttl: Annotated[float, Flag(Group.SESSIONS)] = 3600.0
    """seconds a Responses API response created with `store` (the default) is kept, for
    `previous_response_id` and GET /v1/responses/{id}; 0 keeps none: `store` is then ignored, as
    vLLM does without VLLM_ENABLE_RESPONSES_API_STORE (docs/responses.md)"""
    response_max_bytes: Annotated[int, Flag(Group.SESSIONS, metavar="BYTES")] = 4 * 1024 * 1024
    """largest stored response record (its input items, the chain's included, and the response
    object); a larger one is not stored, and its id answers 404"""
    tenant_header: Annotated[str, Flag(Group.SESSIONS, metavar="HEADER")] = ""
    """header whose value scopes conversations (default: the bearer token)"""
    store_timeout: Annotated[float, Flag(Group.SESSIONS)] = 0.25
    """seconds per session-store call before it counts as down"""
    store_retry_after: Annotated[float, Flag(Group.SESSIONS)] = 2.0
    """the longest the store breaker stays open (it opens on 3 failures in a row or half of the
    calls over 10 s failing, and closes as soon as a ping answers)"""

    reuse: Annotated[bool, Flag(Group.REUSE)] = True
    """send the previous D's handle to P (--no-reuse keeps affinity only)"""
    verify_prefix: Annotated[Literal["tokens", "digest"], Flag(Group.REUSE)] = "tokens"
    """how a new prompt is checked against the KV D holds before a read"""
    min_reuse_tokens: Annotated[int, Flag(Group.REUSE, metavar="TOKENS")] = 0
    """smallest verified prefix worth a D->P pull (0: one block)"""
    decode_local_max_tokens: Annotated[int, Flag(Group.REUSE, metavar="TOKENS")] = 512
    """the decode plan: a turn whose new tokens (those the previous D's prefix cache lacks) are
    at most this many runs on that D alone, no P leg (0: never)"""
    decode_local_max_inflight: Annotated[int, Flag(Group.REUSE)] = 64
    """the decode plan only while the previous D has fewer requests in flight than this"""
    decode_local_idle_inflight: Annotated[int, Flag(Group.REUSE)] = 64
    """the decode plan even when P could pull, while the previous D has fewer requests in flight
    than this (the default: whenever --decode-local-max-inflight allows it): one forward on D
    comes sooner than P's forward, the handover and D's own forward for token 1 (0: only
    when P is as crowded as --decode-local-max-inflight)"""
    prefill_token_ids: Annotated[bool, Flag(Group.REUSE)] = True
    """on a hit verified by P's /tokenize, send P those token ids on /v1/completions instead of
    the chat body: P does not render and tokenize the conversation again"""
    first_token_seeding: Annotated[bool, Flag(Group.REUSE)] = True
    """pass P's sampled token 1 (first_token_ids in P's params, vllm#51919) on to D, which then
    emits it without a forward; --no-first-token-seeding strips it (D computes it)"""
    concurrent_dispatch: Annotated[bool, Flag(Group.REUSE)] = True
    """send D's request beside P's to a D that serves /v1/pd_kv_ready (vllm#51919, learned per
    engine): D parses and admits it while P computes, then gets P's params there"""

    kv_events: Annotated[
        tuple[str, ...],
        Flag(Group.KV_EVENTS, metavar="ENGINE_URL=ZMQ_ENDPOINT[,REPLAY]", repeat=True),
    ] = ()
    """an engine's KV-events publisher and its replay endpoint (by default the next port), once
    per engine, e.g. http://10.0.0.1:8000=tcp://10.0.0.1:5557"""
    kv_events_port: Annotated[int, Flag(Group.KV_EVENTS, metavar="PORT")] = 0
    """every engine not named by --kv-events publishes KV events on its own host at this port,
    replay on the next one (0: none)"""
    kv_events_topic: Annotated[str, Flag(Group.KV_EVENTS, metavar="TOPIC")] = ""
    """the engines' KV-events topic (empty: any)"""
    kv_index_max_blocks: Annotated[int, Flag(Group.KV_EVENTS, metavar="BLOCKS")] = 1_000_000
    """most blocks the KV-events index keeps per engine (the oldest go first)"""

    release_pins: Annotated[bool, Flag(Group.PINS)] = True
    """release the handles nobody will read (superseded, ended, idle, or on a D under pressure),
    so that D frees their pinned blocks before its decoder_kv_blocks_ttl"""
    release_after: Annotated[float, Flag(Group.PINS)] = 0.0
    """seconds a conversation's handle may sit unread on a D under no pin pressure before it is
    released (0: --handle-ttl, past which no turn reads it; at most --handle-ttl)"""
    pin_high_water: Annotated[float, Flag(Group.PINS, metavar="FRACTION")] = 0.9
    """a D's KV usage (0-1) above which the handles on it least likely to be read (idle for the
    most of their conversation's own time between turns) are released, and new conversations go
    to another D, until it is below --pin-low-water"""
    pin_low_water: Annotated[float, Flag(Group.PINS, metavar="FRACTION")] = 0.75
    """the KV usage (0-1) a D under pin pressure is brought below"""

    connect_timeout: Annotated[float, Flag(Group.LIMITS)] = 2.0
    """seconds to connect to an engine"""
    prefill_timeout: Annotated[float, Flag(Group.LIMITS)] = 120.0
    """seconds for a whole prefill request; a P that gives no whole answer in time is ejected at
    once as stalled, so new turns avoid it until its /health answers again"""
    decode_first_byte_timeout: Annotated[float, Flag(Group.LIMITS)] = 120.0
    """seconds until the decode engine's response starts"""
    decode_idle_timeout: Annotated[float, Flag(Group.LIMITS)] = 15.0
    """seconds an engine may stay silent in the middle of its answer (a stream between two
    chunks); past it the turn fails and the engine is ejected at once as stalled, so new turns
    avoid it until its /health answers again"""
    max_body_bytes: Annotated[int, Flag(Group.LIMITS, metavar="BYTES")] = 16 * 1024 * 1024
    """largest accepted request body: a larger declared Content-Length gets 413 before any of it
    is read, a chunked body is cut at the limit"""
    header_timeout: Annotated[float, Flag(Group.LIMITS)] = 75.0
    """seconds a connection may take to send a complete request head (request line and headers),
    counted from its opening or from the end of its previous response; it is also how long an
    idle kept-alive connection stays open (one timer for both, `router/http/idle.py`); idle
    connections are closed as a shutdown begins"""
    body_timeout: Annotated[float, Flag(Group.LIMITS)] = 60.0
    """seconds a client may take to send a whole request body, counted from the end of its
    headers; slower bodies get 408 and the connection is closed"""
    unhealthy_after: Annotated[int, Flag(Group.LIMITS)] = 3
    """consecutive failures that eject an instance"""
    health_interval: Annotated[float, Flag(Group.LIMITS)] = 5.0
    """seconds between health probes of ejected instances, reads of each decode instance's
    process start time (a restart makes its handles unusable), and re-reads of the admin API's
    instance registry"""

    session_secret: Annotated[
        str, Flag(Group.SECURITY, metavar="SECRET[,SECRET...]", first=True)
    ] = ""
    """secret(s) signing each session's handle and digests (HMAC, comma-separated: the first
    signs, each verifies, for rotation), at least 16 characters each, the same on every replica;
    required with --session-store redis unless --unsigned-sessions (the memory store makes its
    own)"""
    unsigned_sessions: Annotated[bool, Flag(Group.SECURITY)] = False
    """store sessions unsigned (no --session-secret): anyone who can write to Redis can then
    change a stored handle's block ids and make P read wrong KV"""
    admin_key: Annotated[str, Flag(Group.SECURITY, metavar="KEY")] = ""
    """the admin API's key: every call under /admin/ sends `Authorization: Bearer KEY`; also the
    X-API-Key of POST /instances/add while --admin-api-key is empty (empty: the admin API is
    disabled)"""
    admin_api_key: Annotated[
        str, Flag(Group.SECURITY, metavar="KEY", env_alias="ADMIN_API_KEY")
    ] = ""
    """a key for POST /instances/add alone, the demo proxies' route, sent as `X-API-Key: KEY` as
    they send it (their ADMIN_API_KEY variable is read too); it opens nothing under /admin/
    (empty: --admin-key; both empty: the route is disabled)"""

    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], Flag(Group.OBSERVABILITY)
    ] = "info"
    """log level"""
    log_format: Annotated[Literal["text", "json"], Flag(Group.OBSERVABILITY)] = "text"
    """log lines as plain text or one JSON object each"""
    otel_endpoint: Annotated[str, Flag(Group.OBSERVABILITY, metavar="URL")] = ""
    """OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces (empty: no tracing; needs
    the 'otel' extra)"""

    @property
    def session_secrets(self) -> tuple[str, ...]:
        """--session-secret as a list: the first signs, each verifies (rotation)."""
        return tuple(s for s in (p.strip() for p in self.session_secret.split(",")) if s)


# Every setting as its flag: what the parser, the environment, a TOML file and the docs read.
FLAGS = declared(Settings)
