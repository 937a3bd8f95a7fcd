"""The reuse verdicts and their reasons: the one source of `X-KV-Reuse`, the metric labels
and the docs table (tests/ops/test_docs.py keeps docs/architecture.md true to it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    HIT = "hit"  # P was given D's handle (possibly cut to the verified prefix)
    MISS = "miss"  # a plain P/D turn; the reason says why nothing was read
    SKIP = "skip"  # reuse was not attempted at all


class Found(StrEnum):
    """How a hit's session was found when the request named none (`hit;id=...`)."""

    HISTORY = "history"  # the request's history begins with the conversation a D holds


FOUND_MEANINGS: dict[Found, str] = {
    Found.HISTORY: "a hit on a session found by the request's history (no conversation id "
    "was sent): its messages begin with exactly the prompt and answer a D holds",
}


class Reason(StrEnum):
    """Why a turn did not read the conversation's KV from D (`miss;reason=...`)."""

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
    TOKENIZE_FAILED = "tokenize-failed"
    HANDLE_REJECTED = "handle-rejected"
    READS_PAUSED = "reads-paused"
    DECODE_RETRIED = "decode-retried"
    DECODE_REMOVED = "decode-removed"
    DECODE_UNHEALTHY = "decode-unhealthy"
    DECODE_RESTARTED = "decode-restarted"
    DECODE_UNREACHABLE = "decode-unreachable"
    STORE_UNAVAILABLE = "store-unavailable"
    REUSE_DISABLED = "reuse-disabled"
    NO_CONVERSATION_ID = "no-conversation-id"
    ERROR = "error"  # only on error responses: no turn ran


# What each reason means, as docs/architecture.md's X-KV-Reuse table says it.
MEANINGS: dict[Reason, str] = {
    Reason.NO_SESSION: "first turn of this conversation (or its state expired)",
    Reason.BUSY: "another turn of the conversation holds the handle right now",
    Reason.NO_HANDLE: "the previous turn left no handle",
    Reason.NO_KV_PARAMS: "D returned no `kv_transfer_params` (D without `bidirectional_kv_xfer`)",
    Reason.STREAM_NO_KV_PARAMS: "the previous turn streamed on an engine without PR #40186",
    Reason.TOOL_CALLS: "the previous answer had tool calls (not reproducible by digest)",
    Reason.NO_TOKEN_IDS: "the previous turn's token ids were not captured",
    Reason.NO_TOKEN_DIGESTS: "the stored state has no token digests to verify against",
    Reason.PROMPT_IDS_DIFFER: "D tokenized the previous prompt into other ids than P computed "
    "them from (see *The P leg by token ids*)",
    Reason.API_MISMATCH: "the handle came from another API (chat vs Responses render differently)",
    Reason.EXPIRED: "older than `--handle-ttl`",
    Reason.PREFIX_MISMATCH: "the new prompt does not extend what D holds (enough)",
    Reason.TOKENIZE_FAILED: "P's `/tokenize` failed, so nothing could be verified",
    Reason.HANDLE_REJECTED: "P refused the handle (500); the turn was redone as a miss",
    Reason.READS_PAUSED: "the P refused the D's last handles in a row; it gets none of them for "
    "a while (30 s, doubling up to 10 min), and another P is used for hits if there is one",
    Reason.DECODE_RETRIED: "D failed before its first byte; the turn was redone",
    Reason.DECODE_REMOVED: "the D holding the blocks was removed from the pool",
    Reason.DECODE_UNHEALTHY: "the D holding the blocks is ejected",
    Reason.DECODE_RESTARTED: "the D restarted since the handle was made (a new "
    "`process_start_time_seconds` on its `/metrics`, read every `--health-interval`, or a new "
    "engine id in its handles, vLLM's `_dp<rank>` suffix aside)",
    Reason.DECODE_UNREACHABLE: "the last read of the D's `/metrics` could not connect (it may "
    "be restarting)",
    Reason.STORE_UNAVAILABLE: "Redis failed or is being skipped by the circuit breaker",
    Reason.REUSE_DISABLED: "`--no-reuse`: affinity only",
    Reason.NO_CONVERSATION_ID: "no `conversation_id`, `X-Conversation-Id`, `session_id` or "
    "`X-Session-ID`",
    Reason.ERROR: "an error response: the request never became a turn",
}

# The reasons that come with `skip` rather than `miss`.
SKIP_REASONS = frozenset({Reason.NO_CONVERSATION_ID, Reason.REUSE_DISABLED, Reason.ERROR})


@dataclass(frozen=True)
class Reuse:
    """The `X-KV-Reuse` verdict: hit (with the tokens P may read), or miss/skip with a reason."""

    outcome: Outcome
    reason: Reason | None = None
    tokens: int = 0
    found: Found | None = None  # a hit's session was found this way, not by its id

    @classmethod
    def hit(cls, tokens: int, found: Found | None = None) -> Reuse:
        return cls(Outcome.HIT, tokens=tokens, found=found)

    @classmethod
    def miss(cls, reason: Reason | str) -> Reuse:
        """A miss, or a skip for the reasons that mean reuse was never tried."""
        why = Reason(reason)
        return cls(Outcome.SKIP if why in SKIP_REASONS else Outcome.MISS, why)

    @property
    def is_hit(self) -> bool:
        return self.outcome is Outcome.HIT

    def header(self) -> str:
        if self.reason:
            return f"{self.outcome};reason={self.reason}"
        return f"{self.outcome};id={self.found}" if self.found else str(self.outcome)

    def labels(self) -> tuple[str, str]:
        """The reuse metric's (outcome, reason) labels; a hit's reason label says how its
        session was found ("history"), empty for a conversation id."""
        return str(self.outcome), str(self.reason or self.found or "")


def header_values() -> list[str]:
    """Every X-KV-Reuse value the router sends, as the docs table lists them."""
    values = [str(Outcome.HIT)]
    values += [Reuse.hit(0, found).header() for found in Found]
    values += [Reuse.miss(reason).header() for reason in Reason]
    return values


def docs_table() -> str:
    """docs/architecture.md's X-KV-Reuse table (tests/ops/test_docs.py checks it is there)."""
    rows = ["| value | meaning |", "|---|---|"]
    rows.append("| `hit` | P was given D's handle (possibly cut to the verified prefix) |")
    rows += [f"| `{Reuse.hit(0, f).header()}` | {FOUND_MEANINGS[f]} |" for f in Found]
    rows += [f"| `{Reuse.miss(r).header()}` | {MEANINGS[r]} |" for r in Reason]
    return "\n".join(rows)
