"""The reuse verdicts and what each reason means (`Reason` is sessions/vocabulary.py's): the one
source of `X-KV-Reuse`, the metric labels and the docs table (tests/ops/test_docs.py keeps
docs/architecture.md true to it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sessions.vocabulary import Reason as Reason  # re-exported: the router imports it here


class Outcome(StrEnum):
    HIT = "hit"  # P was given D's handle (possibly cut to the verified prefix) and read it
    MISS = "miss"  # a plain P/D turn; the reason says why nothing was read
    SKIP = "skip"  # reuse was not attempted at all


class Via(StrEnum):
    """How a hit's verified prefix reached P when P read nothing from D (`hit;via=...`)."""

    PREFILL_CACHE = "prefill-cache"  # P's own prefix cache held it: nothing read from D
    DECODE = "decode"  # the decode plan: the turn ran on the previous D alone, no P leg
    STORE = "store"  # --kv-connector store: P reported cached prompt tokens (store or its own)


VIA_MEANINGS: dict[Via, str] = {
    Via.PREFILL_CACHE: "the chosen P's own prefix cache held the verified prefix, so "
    "nothing was read from D: its KV events said so, or it computed that prompt on the "
    "conversation's last turn (no handle was sent: a read of what it lacks was not needed, "
    "or is under the fewest tokens it reads, its `kv_recompute_threshold` as learned); or P "
    "was sent the handle and reported "
    "fewer cached prompt tokens than it names, so it read nothing (what it lacked was under "
    "its `kv_recompute_threshold`, 64 by default, and recomputed); the reused tokens are "
    "what P's cache held",
    Via.DECODE: "the decode plan: the whole turn went to the previous D, whose prefix cache "
    "holds the conversation (what it lacks bounded from the session's state, or verified by "
    "its `/tokenize`); no P leg, nothing moved, D computed only the new tokens "
    "(`--decode-local-max-tokens`), while it had room (`--decode-local-idle-inflight`) or no "
    "pull was possible; the reused tokens are the full blocks it held",
    Via.STORE: "`--kv-connector store`: P reported this many cached prompt tokens "
    "(`usage.prompt_tokens_details.cached_tokens`), found in the shared store or its own "
    "prefix cache (vLLM's per-request count does not say which; its "
    "`vllm:prompt_tokens_by_source_total` does; with `--kv-events`, a count that P's own "
    "cache held entirely is `hit;via=prefill-cache` instead); no handle exists in this mode",
}


HIT_MEANING = (
    "P was given D's handle (possibly cut to the verified prefix) and read KV from D: the "
    "chosen P was not known to hold the verified prefix (by its KV events, or by the prompt "
    "it computed on the conversation's last turn), and the cached prompt tokens it reported "
    "reach the handle's (when it reports them: `--enable-prompt-tokens-details`)"
)


class Found(StrEnum):
    """How a hit's session was found when the request named none (`hit;id=...`)."""

    HISTORY = "history"  # the request's history begins with the conversation a D holds


FOUND_MEANINGS: dict[Found, str] = {
    Found.HISTORY: "a hit on a session found by the request's history (no conversation id "
    "was sent): its messages begin with exactly the prompt and answer a D holds",
}


# What each reason means, as docs/architecture.md's X-KV-Reuse table says it.
MEANINGS: dict[Reason, str] = {
    Reason.NO_SESSION: "first turn of this conversation (or its state expired)",
    Reason.BUSY: "another turn of the conversation holds the handle right now",
    Reason.NO_HANDLE: "the previous turn left no handle",
    Reason.NO_KV_PARAMS: "D returned no `kv_transfer_params` (D without `bidirectional_kv_xfer`)",
    Reason.STREAM_NO_KV_PARAMS: "the previous turn streamed on an engine without PR #40186",
    Reason.TOOL_CALLS: "the previous answer had tool calls (not reproducible by digest)",
    Reason.NO_TOKEN_IDS: "the previous turn's token ids were not captured (its D was not yet "
    "known to stream `kv_transfer_params` and the decode plan is off, or an engine without "
    "`return_token_ids`)",
    Reason.NO_TOKEN_DIGESTS: "the stored state has no token digests to verify against",
    Reason.PROMPT_IDS_DIFFER: "D tokenized the previous prompt into other ids than P computed "
    "them from (see *The P leg by token ids*)",
    Reason.API_MISMATCH: "the handle came from another API (chat vs Responses render differently)",
    Reason.EXPIRED: "older than `--handle-ttl`",
    Reason.RELEASED: "the router released the handle (unread too long, or its D short of KV "
    "memory) so that D could free the pinned blocks",
    Reason.STALE_HANDLE: "the stored handle was read or released before (the session record "
    "is older than the conversation: a lagging replica, a restore, a failover or a "
    "DUMP/RESTORE), so D may have reused its blocks: it is never read (a WARNING says which)",
    Reason.PREFIX_MISMATCH: "the new prompt does not extend what D holds (enough)",
    Reason.EVICTED: "D's KV events say it evicted or cleared blocks of the handle since it "
    "was made: it was dropped before any read",
    Reason.TOKENIZE_FAILED: "P's `/tokenize` (Responses: `/v1/responses/render`) failed, so "
    "nothing could be verified",
    Reason.HANDLE_REJECTED: "P refused the handle (500); the turn was redone as a miss",
    Reason.READS_PAUSED: "the P refused the D's last handles in a row; it gets none of them for "
    "a while (30 s, doubling up to 10 min), and another P is used for hits if there is one",
    Reason.DECODE_RETRIED: "D failed before its first byte; the turn was redone",
    Reason.DECODE_LOCAL: "the previous turn ran on D alone (the decode plan) and D returned no "
    "handle (a D without `bidirectional_kv_xfer` keeps nothing for P), so there is none to "
    "pull (its D's prefix cache still holds the conversation)",
    Reason.DECODE_LOCAL_FAILED: "the decode plan's D failed before its first byte; the turn "
    "was redone as an ordinary P/D turn on another D where there is one",
    Reason.DECODE_REMOVED: "the D holding the blocks was removed from the pool",
    Reason.DECODE_UNHEALTHY: "the D holding the blocks is ejected",
    Reason.DECODE_RESTARTED: "the D restarted since the handle was made (a new "
    "`process_start_time_seconds` on its `/metrics`, read every `--health-interval`, or a new "
    "engine id in its handles, vLLM's `_dp<rank>` suffix aside)",
    Reason.DECODE_UNREACHABLE: "the last read of the D's `/metrics` could not connect (it may "
    "be restarting)",
    Reason.REGISTRATION_CHANGED: "the D discarded and registered its KV cache again since the "
    "handle was made (a sleep: its `vllm:engine_sleep_state` seen by the health loop, or, vLLM "
    "0.33, a newer `remote_registration_generation` in its later handles): the handle names "
    "blocks of the old registration, so it is not read",
    Reason.CONNECTOR_MISMATCH: "no usable P runs a NIXL connector version the handle's D can "
    "handshake with (a fleet in the middle of a vLLM upgrade: 0.32 is version 14, 0.33 is 15)",
    Reason.STORE_UNAVAILABLE: "Redis failed or is being skipped by the circuit breaker",
    Reason.CORRUPT_STATE: "the conversation's Redis key held no valid state (a field that does "
    "not decode, a key of another type); the key was dropped, the next turn starts afresh",
    Reason.STORED_REASON_UNKNOWN: "the previous turn left no handle, for a reason this router "
    "does not know (its state was written by a newer router, or edited by hand)",
    Reason.HANDLE_UNAUTHENTICATED: "the session's HMAC does not match any `--session-secret`: "
    "its handle or digests were changed outside the router (or its secret was dropped)",
    Reason.HANDLE_INVALID: "the stored handle fails the router's checks (not a handle, "
    "`remote_num_tokens` other than the stored token count, too few or too many blocks, "
    "another engine id than the one stored, or an engine id, side-channel host and port that "
    "the recorded D did not announce: in its own answers to this process or in a state signed "
    "with our secret), so it could aim P at another address: it is sent to no P, not even for "
    "a release",
    Reason.STORE_MISSED: "`--kv-connector store`: P reported no cached prompt tokens for a "
    "continuing conversation (the store lost or never got its blocks, or the engines run "
    "without `--enable-prompt-tokens-details`): P computed the whole history",
    Reason.RECOMPUTED: "P was to find the verified prefix in D's blocks or its own prefix "
    "cache, but it reported no cached prompt tokens "
    "(`usage.prompt_tokens_details.cached_tokens`): it read nothing from D and recomputed the "
    "prompt (a read that failed under `kv_load_failure_policy=recompute`, or blocks its cache "
    "was expected to hold and had evicted, or a P restarted since)",
    Reason.RECOMPUTE_CHEAPER: "the conversation is shorter than the fewest tokens P reads "
    "from D (vLLM skips a read under its `kv_recompute_threshold`, 64 by default; the router "
    "learns it from P's answers): P recomputes it, and the turn spends no /tokenize or "
    "verification on a handle (released after the turn). Where P computed the conversation's "
    "last prompt, such a turn says `hit;via=prefill-cache` instead",
    Reason.REUSE_DISABLED: "`--no-reuse`: affinity only",
    Reason.NO_CONVERSATION_ID: "no `conversation_id`, `X-Conversation-Id`, `session_id`, "
    "`X-Session-ID` or `vllm_xargs.session_id`",
    Reason.PUSH_AFFINITY: "`--kv-connector nixl-push`: vLLM has no D->P reuse for push "
    "(vllm#46473), so nothing is read from D; the conversation keeps its P and D (affinity), "
    "whose prefix caches may still hold its earlier turns",
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
    via: Via | None = None  # a hit whose prefix reached P another way than a read from D
    found: Found | None = None  # a hit's session was found this way, not by its id

    @classmethod
    def hit(cls, tokens: int, via: Via | None = None, found: Found | None = None) -> Reuse:
        return cls(Outcome.HIT, tokens=tokens, via=via, found=found)

    @classmethod
    def miss(cls, reason: Reason) -> Reuse:
        """A miss, or a skip for the reasons that mean reuse was never tried."""
        return cls(Outcome.SKIP if reason in SKIP_REASONS else Outcome.MISS, reason)

    @property
    def is_hit(self) -> bool:
        """The verified prefix reaches P without being computed (read from D or P's own)."""
        return self.outcome is Outcome.HIT

    @property
    def pulls(self) -> bool:
        """P reads the verified prefix from D."""
        return self.is_hit and self.via is None

    @property
    def source(self) -> str:
        """The reused tokens' source label: decode_pull, prefill_cache or store ("" on no hit)."""
        if not self.is_hit:
            return ""
        return "decode_pull" if self.via is None else str(self.via).replace("-", "_")

    def header(self) -> str:
        if self.reason:
            return f"{self.outcome};reason={self.reason}"
        return ";".join([str(self.outcome), *self._hit_parts()])

    def _hit_parts(self) -> list[str]:
        parts = [f"via={self.via}"] if self.via is not None else []
        return parts + ([f"id={self.found}"] if self.found is not None else [])

    def labels(self) -> tuple[str, str]:
        """The reuse metric's (outcome, reason) labels: a hit's reason label is what its
        header says after `hit;` ("via=prefill-cache", "id=history"), empty otherwise."""
        return str(self.outcome), str(self.reason or ";".join(self._hit_parts()))


def header_values() -> list[str]:
    """Every X-KV-Reuse value the router sends, as the docs table lists them."""
    values = [str(Outcome.HIT)]
    values += [Reuse.hit(0, via).header() for via in Via]
    values += [Reuse.hit(0, found=found).header() for found in Found]
    values += [Reuse.miss(reason).header() for reason in Reason]
    return values


def docs_table() -> str:
    """docs/architecture.md's X-KV-Reuse table (tests/ops/test_docs.py checks it is there)."""
    rows = ["| value | meaning |", "|---|---|"]
    rows.append(f"| `hit` | {HIT_MEANING} |")
    rows += [f"| `{Reuse.hit(0, v).header()}` | {VIA_MEANINGS[v]} |" for v in Via]
    rows += [f"| `{Reuse.hit(0, found=f).header()}` | {FOUND_MEANINGS[f]} |" for f in Found]
    rows += [f"| `{Reuse.miss(r).header()}` | {MEANINGS[r]} |" for r in Reason]
    return "\n".join(rows)
