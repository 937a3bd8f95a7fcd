"""One conversation turn, top to bottom: claim, then the connector's legs (which verify,
place, prefill, decode, relay and commit), and what ends a turn that failed. The decisions
are the decision core's (router/turn/decide/); the steps apply them."""

from __future__ import annotations

import asyncio
import time
import uuid

from starlette.responses import Response

from router.errors import EngineReply
from router.services import Services
from router.turn import ahead, early, pins
from router.turn.claim import claim
from router.turn.commit import abort
from router.turn.incoming import Incoming
from router.turn.state import Turn
from sessions.vocabulary import AbortReason


def new_request_id() -> str:
    return uuid.uuid4().hex


async def run_turn(svc: Services, inc: Incoming, request_id: str) -> Response:
    """Serve one client request through P and D; the response may still be streaming."""
    started = time.monotonic()
    sent = ahead.start(svc, inc, request_id)  # D's leg beside the claim, if it runs there
    tokens = early.start(svc, inc, request_id) if sent is None else None  # ... or P's ids
    try:
        found = await claim(svc, inc, request_id)
    except BaseException:
        if tokens is not None:
            tokens.cancel()
        ahead.end(svc, sent)
        raise
    turn = Turn(svc, inc, request_id, found, started, early=tokens, ahead=sent)
    pins.measure_gap(turn)
    try:
        return await svc.connector.serve(turn)
    except EngineReply as reply:
        await abort(turn, AbortReason.engine(reply.status))
        headers = turn.final_headers()
        if reply.retry_after is not None:
            headers["Retry-After"] = str(reply.retry_after)
        return Response(reply.body, reply.status, headers=headers, media_type="application/json")
    except asyncio.CancelledError:
        await asyncio.shield(abort(turn, AbortReason.CLIENT_DISCONNECTED))
        raise
    except BaseException as exc:
        await abort(turn, AbortReason.raised(exc))
        raise
    finally:
        if tokens is not None:
            tokens.cancel()  # a turn that did not need them (done: nothing happens)
        ahead.end(svc, sent)
