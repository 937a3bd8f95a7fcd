"""The words sessions and the router share: reuse reasons, abort reasons, commit results, leg
outcomes. Imports nothing from the project, so both may use it (the arq `constants.py` way)."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Why a turn did not read the conversation's KV from D (`miss;reason=...`).

    Their meanings, the header and the docs table are in router/turn/outcomes.py."""

    NO_SESSION = "no-session"
    BUSY = "busy"
    NO_HANDLE = "no-handle"
    NO_KV_PARAMS = "no-kv-params"
    STREAM_NO_KV_PARAMS = "stream-no-kv-params"
    TOOL_CALLS = "tool-calls"
    NO_TOKEN_IDS = "no-token-ids"
    NO_TOKEN_DIGESTS = "no-token-digests"
    PROMPT_IDS_DIFFER = "prompt-ids-differ"
    API_MISMATCH = "api-mismatch"
    EXPIRED = "expired"
    RELEASED = "released"  # the router gave the handle back so that D frees its blocks
    # The stored handle was read or released before: the record is older than the conversation
    # (a lagging replica, a restore), and D may have reused its blocks (issue 48).
    STALE_HANDLE = "stale-handle"
    PREFIX_MISMATCH = "prefix-mismatch"
    EVICTED = "evicted"
    TOKENIZE_FAILED = "tokenize-failed"
    HANDLE_REJECTED = "handle-rejected"
    READS_PAUSED = "reads-paused"
    DECODE_RETRIED = "decode-retried"
    DECODE_LOCAL = "decode-local"
    DECODE_LOCAL_FAILED = "decode-local-failed"
    DECODE_REMOVED = "decode-removed"
    DECODE_UNHEALTHY = "decode-unhealthy"
    DECODE_RESTARTED = "decode-restarted"
    DECODE_UNREACHABLE = "decode-unreachable"
    REGISTRATION_CHANGED = "registration-changed"  # vLLM 0.33: D registered its KV again
    CONNECTOR_MISMATCH = "connector-mismatch"  # no usable P speaks the D's connector version
    STORE_UNAVAILABLE = "store-unavailable"
    CORRUPT_STATE = "corrupt-state"
    STORED_REASON_UNKNOWN = "stored-reason-unknown"  # see `stored`
    HANDLE_UNAUTHENTICATED = "handle-unauthenticated"
    HANDLE_INVALID = "handle-invalid"
    STORE_MISSED = "store-missed"
    # P read nothing from D and its own cache held none of the verified prefix (issue 50).
    RECOMPUTED = "recomputed"
    # P lacks fewer of D's tokens than it reads (issue 49): no handle, no /tokenize.
    RECOMPUTE_CHEAPER = "recompute-cheaper"
    REUSE_DISABLED = "reuse-disabled"
    NO_CONVERSATION_ID = "no-conversation-id"
    PUSH_AFFINITY = "push-affinity"
    ERROR = "error"  # only on error responses: no turn ran

    @classmethod
    def stored(cls, value: str) -> Reason:
        """A reason read back from the store. One this router does not know (written by a newer
        router during a rollout, or by hand) is STORED_REASON_UNKNOWN, never an error."""
        try:
            return cls(value)
        except ValueError:
            return cls.STORED_REASON_UNKNOWN


class AbortReason(StrEnum):
    """Why a turn committed nothing (`kvbaton_turns_aborted_total{reason}`, `aborted:<reason>`).

    Three families carry a detail: `finish`, `engine` and `raised` spell them."""

    CLIENT_DISCONNECTED = "client-disconnected"
    DECODE_BROKE = "decode-broke"  # D's stream failed after the first byte
    DECODE_ERROR_EVENT = "decode-error-event"  # D sent an SSE error event
    # D answered 200 with what the API does not promise (HTML, half a body, a cut stream)
    DECODE_MALFORMED = "decode-malformed"

    @staticmethod
    def finish(finish_reason: str | None) -> str:
        """`finish-<finish_reason>`: D finished other than stop/length (`finish-missing`)."""
        return f"finish-{finish_reason or 'missing'}"

    @staticmethod
    def engine(status: int) -> str:
        """`engine-<status>`: an engine's 4xx, passed to the client."""
        return f"engine-{status}"

    @staticmethod
    def raised(exc: BaseException) -> str:
        """The type name of the exception that ended the turn."""
        return type(exc).__name__


class CommitResult(StrEnum):
    """The session write after a normal finish (`kvbaton_session_commits_total{result}`)."""

    COMMITTED = "committed"
    LOST_RACE = "lost-race"  # another turn of the conversation committed first (compare-and-set)
    STORE_UNAVAILABLE = "store-unavailable"
    NO_CONVERSATION_ID = "no-conversation-id"


class LegOutcome(StrEnum):
    """How an engine call ended (`kvbaton_upstream_duration_seconds{outcome}`)."""

    OK = "ok"
    ERROR = "error"  # 5xx, timeout, connection
    REJECTED = "rejected"  # P answered 4xx
    CLIENT_ERROR = "client-error"  # D: a 4xx, passed to the client
