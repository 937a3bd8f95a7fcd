"""Every setting `kvbaton serve` takes (name, help, type, choices) and the help group each is
listed in. `config.py` builds `Settings` from them, `command_line.py` the parser and
`config_docs.py` docs/configuration.md."""

from __future__ import annotations

from router.connectors.names import ConnectorName
from router.flag import GROUPS, Flag, Group

FLAGS: tuple[Flag, ...] = (
    Flag(
        "prefill",
        "prefill (P) instance base URLs (a bare host:port means http://host:port); none needed "
        "with --moriio-register",
        many=True,
        metavar="URL",
        required=True,
    ),
    Flag(
        "decode",
        "decode (D) instance base URLs (a bare host:port means http://host:port); none needed "
        "with --moriio-register",
        many=True,
        metavar="URL",
        required=True,
    ),
    Flag("host", "address to listen on", metavar="HOST"),
    Flag("port", "port to listen on", int, metavar="PORT"),
    Flag(
        "workers",
        "router processes sharing the listening socket, each with its own event loop and "
        "engine connections (more than 1 needs the redis session store)",
        int,
    ),
    Flag(
        "event_loop",
        "each process's event loop: 'uvloop' (libuv, as Hypercorn's uvloop worker class) or "
        "the standard library's 'asyncio' (docs/benchmarks.md compares the two)",
        choices=("uvloop", "asyncio"),
    ),
    Flag("redis_url", "Redis URL for session state", metavar="URL"),
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
    Flag(
        "response_ttl",
        "seconds a Responses API response created with `store` (the default) is kept, for "
        "`previous_response_id` and GET /v1/responses/{id}; 0 keeps none: `store` is then "
        "ignored, as vLLM does without VLLM_ENABLE_RESPONSES_API_STORE (docs/responses.md)",
        float,
    ),
    Flag(
        "response_max_bytes",
        "largest stored response record (its input items, the chain's included, and the "
        "response object); a larger one is not stored, and its id answers 404",
        int,
        metavar="BYTES",
    ),
    Flag(
        "release_pins",
        "release the handles nobody will read (superseded, ended, idle, or on a D under "
        "pressure), so that D frees their pinned blocks before its decoder_kv_blocks_ttl",
        bool,
    ),
    Flag(
        "release_after",
        "seconds a conversation's handle may sit unread on a D under no pin pressure before "
        "it is released (0: --handle-ttl, past which no turn reads it; at most --handle-ttl)",
        float,
    ),
    Flag(
        "pin_high_water",
        "a D's KV usage (0-1) above which the handles on it least likely to be read (idle for "
        "the most of their conversation's own time between turns) are released, and new "
        "conversations go to another D, until it is below --pin-low-water",
        float,
        metavar="FRACTION",
    ),
    Flag(
        "pin_low_water",
        "the KV usage (0-1) a D under pin pressure is brought below",
        float,
        metavar="FRACTION",
    ),
    Flag("reuse", "send the previous D's handle to P (--no-reuse keeps affinity only)", bool),
    Flag(
        "history_sessions",
        "find the session of a request without a conversation id by its history (a "
        "tenant-scoped digest of the conversation a D holds)",
        bool,
    ),
    Flag(
        "verify_prefix",
        "how a new prompt is checked against the KV D holds before a read",
        choices=("tokens", "digest"),
    ),
    Flag(
        "block_size",
        "engine KV block size in tokens (0: read vllm:cache_config_info)",
        int,
        metavar="TOKENS",
    ),
    Flag(
        "min_reuse_tokens",
        "smallest verified prefix worth a D->P pull (0: one block)",
        int,
        metavar="TOKENS",
    ),
    Flag(
        "stream_kv_params",
        "the decode engines stream kv_transfer_params in the final SSE chunk (vLLM PR #40186), "
        "from the first turn; not needed for vLLM 0.33, whose `/version` says so",
        bool,
    ),
    Flag(
        "first_token_seeding",
        "pass P's sampled token 1 (first_token_ids in P's params, vllm#51919) on to D, which "
        "then emits it without a forward; --no-first-token-seeding strips it (D computes it)",
        bool,
    ),
    Flag(
        "concurrent_dispatch",
        "send D's request beside P's to a D that serves /v1/pd_kv_ready (vllm#51919, learned "
        "per engine): D parses and admits it while P computes, then gets P's params there",
        bool,
    ),
    Flag(
        "decode_local_max_tokens",
        "the decode plan: a turn whose new tokens (those the previous D's prefix cache lacks) "
        "are at most this many runs on that D alone, no P leg (0: never)",
        int,
        metavar="TOKENS",
    ),
    Flag(
        "decode_local_max_inflight",
        "the decode plan only while the previous D has fewer requests in flight than this",
        int,
    ),
    Flag(
        "kv_connector",
        "the engines' KV-transfer protocol (nixl: NixlConnector pull, with D->P reuse; "
        "nixl-push: NixlPushConnector, P and D called concurrently, affinity only; "
        "store: KV through a shared store such as MooncakeStoreConnector, no kv_transfer_params; "
        "moriio: MoRIIOConnector, READ or WRITE as the instances announce, affinity only)",
        choices=tuple(name.value for name in ConnectorName),
    ),
    Flag(
        "moriio_register",
        "a ZMQ endpoint (tcp://HOST:PORT) the router binds for MoRI-IO instances' "
        "announcements (vLLM's toy proxy binds tcp://0.0.0.0:36367); empty: none",
        metavar="tcp://HOST:PORT",
    ),
    Flag(
        "moriio_register_ttl",
        "seconds after its last announcement that a MoRI-IO instance is dropped",
        float,
    ),
    Flag(
        "data_parallel_size",
        "an engine's internal data-parallel size (vllm serve --data-parallel-size), once per "
        "engine: each conversation stays on one rank (X-data-parallel-rank), new ones "
        "are spread over the ranks",
        many=True,
        repeat=True,
        metavar="URL=N",
    ),
    Flag(
        "prefill_coordinates",
        "nixl-push: a P instance's side-channel coordinates, once per P (a P not named is "
        "probed for them), e.g. "
        "http://10.0.0.1:8100=prefill-0@10.0.0.1:5600",
        many=True,
        repeat=True,
        metavar="URL=ENGINE_ID@SIDE_HOST:SIDE_PORT[,tp=N][,pp=N]",
    ),
    Flag(
        "prefill_token_ids",
        "on a hit verified by P's /tokenize, send P those token ids on /v1/completions "
        "instead of the chat body: P does not render and tokenize the conversation again",
        bool,
    ),
    Flag(
        "kv_events",
        "an engine's KV-events publisher and its replay endpoint (by default the next port), "
        "once per engine, e.g. http://10.0.0.1:8000=tcp://10.0.0.1:5557",
        many=True,
        repeat=True,
        metavar="ENGINE_URL=ZMQ_ENDPOINT[,REPLAY]",
    ),
    Flag(
        "kv_events_port",
        "every engine not named by --kv-events publishes KV events on its own host at this "
        "port, replay on the next one (0: none)",
        int,
        metavar="PORT",
    ),
    Flag("kv_events_topic", "the engines' KV-events topic (empty: any)", metavar="TOPIC"),
    Flag(
        "kv_index_max_blocks",
        "most blocks the KV-events index keeps per engine (the oldest go first)",
        int,
        metavar="BLOCKS",
    ),
    Flag("engine_api_key", "Bearer key sent to the engines (vLLM --api-key)", metavar="KEY"),
    Flag(
        "tenant_header",
        "header whose value scopes conversations (default: the bearer token)",
        metavar="HEADER",
    ),
    Flag(
        "admin_key",
        "the admin API's key: every call under /admin/ sends `Authorization: Bearer KEY`; "
        "also the X-API-Key of POST /instances/add while --admin-api-key is empty (empty: "
        "the admin API is disabled)",
        metavar="KEY",
    ),
    Flag(
        "session_secret",
        "secret(s) signing each session's handle and digests (HMAC, comma-separated: the first "
        "signs, each verifies, for rotation), at least 16 characters each, the same on every "
        "replica; required with --session-store redis unless --unsigned-sessions (the memory "
        "store makes its own)",
        metavar="SECRET[,SECRET...]",
    ),
    Flag(
        "unsigned_sessions",
        "store sessions unsigned (no --session-secret): anyone who can write to Redis can "
        "then change a stored handle's block ids and make P read wrong KV",
        bool,
    ),
    Flag(
        "admin_api_key",
        "a key for POST /instances/add alone, the demo proxies' route, sent as `X-API-Key: KEY` "
        "as they send it (their ADMIN_API_KEY variable is read too); it opens nothing under "
        "/admin/ (empty: --admin-key; both empty: the route is disabled)",
        env_alias="ADMIN_API_KEY",
        metavar="KEY",
    ),
    Flag(
        "model",
        "served model name the engines must report (empty: take the engines')",
        metavar="NAME",
    ),
    Flag("connect_timeout", "seconds to connect to an engine", float),
    Flag(
        "prefill_timeout",
        "seconds for a whole prefill request; a P that gives no whole answer in time is ejected "
        "at once as stalled, so new turns avoid it until its /health answers again",
        float,
    ),
    Flag("decode_first_byte_timeout", "seconds until the decode engine's response starts", float),
    Flag(
        "decode_idle_timeout",
        "seconds an engine may stay silent in the middle of its answer (a stream between two "
        "chunks); past it the turn fails and the engine is ejected at once as stalled, so new "
        "turns avoid it until its /health answers again",
        float,
    ),
    Flag("store_timeout", "seconds per session-store call before it counts as down", float),
    Flag(
        "store_retry_after",
        "the longest the store breaker stays open (it opens on 3 failures in a row or half of "
        "the calls over 10 s failing, and closes as soon as a ping answers)",
        float,
    ),
    Flag(
        "max_body_bytes",
        "largest accepted request body: a larger declared Content-Length gets 413 before any "
        "of it is read, a chunked body is cut at the limit",
        int,
        metavar="BYTES",
    ),
    Flag(
        "header_timeout",
        "seconds a connection may take to send a complete request head (request line and "
        "headers), counted from its opening or from the end of its previous response; it is "
        "also how long an idle kept-alive connection stays open (one timer for both, "
        "`router/http/idle.py`); idle connections are closed as a shutdown begins",
        float,
    ),
    Flag(
        "body_timeout",
        "seconds a client may take to send a whole request body, counted from the end of its "
        "headers; slower bodies get 408 and the connection is closed",
        float,
    ),
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
        metavar="URL",
    ),
)


def grouped() -> list[tuple[Group, tuple[Flag, ...]]]:
    """Each group with its flags, in the order GROUPS lists them."""
    by_name = {flag.name: flag for flag in FLAGS}
    return [(group, tuple(by_name[name] for name in names)) for group, names in GROUPS.items()]
