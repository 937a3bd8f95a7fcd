"""The words sessions and the router share: reuse reasons. Imports nothing from the project, so
both may use it (the arq `constants.py` way)."""

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
    STORE_UNAVAILABLE = "store-unavailable"
    CORRUPT_STATE = "corrupt-state"
    STORED_REASON_UNKNOWN = "stored-reason-unknown"  # see `stored`
    HANDLE_UNAUTHENTICATED = "handle-unauthenticated"
    HANDLE_INVALID = "handle-invalid"
    STORE_MISSED = "store-missed"
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
