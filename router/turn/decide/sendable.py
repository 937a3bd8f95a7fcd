"""May the claimed handle reach a P? What a claimed state allows, why a handle naming that D
must not be sent, the router's own checks of a stored handle, and which ones may still be
released. Pure: the claim and the legs apply them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from router.engines.identity import engine_family
from router.engines.pool import Instance
from router.engines.versions import registration_generation
from router.turn.outcomes import Reason, Reuse
from sessions import model as sm
from sessions.model import SessionState


def claimed_reuse(
    state: SessionState | None, api: str, now: float, decode: Instance | None
) -> Reuse:
    """What a claimed state allows: a hit on its handle, or the reason it may not be sent."""
    unusable = sm.handle_unusable_reason(state, api, now)
    if unusable is not None:
        return Reuse.miss(unusable)
    assert state is not None
    blocker = decode_blocker(decode, state)
    if blocker is not None:
        return Reuse.miss(blocker)
    return Reuse.hit(state.token_count)


def decode_blocker(inst: Instance | None, state: SessionState) -> Reason | None:
    """Why a handle naming that D must not reach P (None: it may)."""
    if inst is None:
        return Reason.DECODE_REMOVED  # the router no longer routes to it
    if not inst.healthy:
        return Reason.DECODE_UNHEALTHY
    # D restarted since this handle was made: its blocks and engine id are gone, and a read
    # would fail (kv_load_failure_policy=fail) or, worse, hang on a handshake. The health loop
    # sees a new process start time within one interval; a handle captured since shows a new
    # engine id.
    if inst.ident.restarted_since(state.decode_started, state.decode_engine_id):
        return Reason.DECODE_RESTARTED
    if inst.ident.unreachable:  # maybe restarting: nothing says its blocks are still its own
        return Reason.DECODE_UNREACHABLE
    # vLLM 0.33: D re-registered its KV (a sleep) since; the handle's block ids are the old
    # registration's, and a P that handshakes afresh would read whatever they hold now.
    # A handle without one (0.32's, or a malformed one: handle_check's) is judged by time.
    generation = registration_generation(state.kv_transfer_params)
    if inst.ident.registration_changed(generation, state.updated_at):
        return Reason.REGISTRATION_CHANGED
    return None


class HandleReader(Protocol):
    """What the handle check asks of the connector (connectors/base.py's `Connector` is one)."""

    def is_handle(self, params: object) -> bool: ...
    def engine_id(self, params: Mapping[str, Any]) -> str | None: ...


def handle_check(connector: HandleReader, state: SessionState) -> Reason | None:
    """The router's own checks of a stored handle before it may reach P: the state is read
    back from Redis, so it is checked as if a client had sent it (None: it passes)."""
    params = state.kv_transfer_params
    if params is None or not connector.is_handle(params):
        return Reason.HANDLE_INVALID
    if params.get("remote_num_tokens") != state.token_count or state.token_count <= 0:
        return Reason.HANDLE_INVALID
    if engine_family(connector.engine_id(params) or "") != engine_family(state.decode_engine_id):
        return Reason.HANDLE_INVALID
    groups = params.get("remote_block_ids")
    if state.block_size > 0 and isinstance(groups, list):
        need = -(-state.token_count // state.block_size)
        # Full-attention groups hold exactly the blocks of those tokens (vLLM may have given
        # the last, not yet computed token a block of its own); sliding-window ones fewer.
        longest = max((len(g) for g in groups if isinstance(g, list)), default=0)
        if not need <= longest <= need + 1:
            return Reason.HANDLE_INVALID
    return None


# A taken handle that must not go to a P even to be released: one the router cannot trust
# (tampered with: it could aim P at any address), spent before (read or released already),
# whose D no longer holds it, or whose D the P's have been refusing (a release through them
# would fail the same way).
NOT_RELEASABLE = frozenset(
    {
        Reason.READS_PAUSED,
        Reason.HANDLE_UNAUTHENTICATED,
        Reason.HANDLE_INVALID,
        Reason.STALE_HANDLE,
        Reason.DECODE_REMOVED,
        Reason.DECODE_UNHEALTHY,
        Reason.DECODE_RESTARTED,
        Reason.DECODE_UNREACHABLE,
        Reason.REGISTRATION_CHANGED,
    }
)


def releasable(reason: Reason | None) -> bool:
    """Whether a handle the claim took may be released (sent to a P that reads nothing)."""
    return reason not in NOT_RELEASABLE
