"""`DELETE /v1/conversations/{id}`: a client ends its conversation, so its state is forgotten
and the KV that D pins for it is released at once (not after D's 480 s TTL)."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.errors import BadRequest, NotFound, Unavailable
from router.services import Services
from router.turn import ahead, pins
from router.turn.run import new_request_id
from router.turn.tenant import tenant_of_headers, validate_conversation_id
from sessions.keys import conversation_key
from sessions.store import StoreError


async def delete(request: Request) -> Response:
    """OpenAI's shape (`{"id", "object": "conversation.deleted", "deleted"}`), scoped to the
    caller's tenant (its bearer token or --tenant-header) like its turns."""
    svc: Services = request.app.state.services
    request_id = request.state.request_id = new_request_id()
    conversation_id = validate_conversation_id(request.path_params["conversation_id"])
    tenant = tenant_of_headers(request.headers, svc.settings.tenant_header)
    try:
        key = conversation_key(tenant, conversation_id)
    except ValueError as exc:
        raise BadRequest(str(exc), param="conversation_id") from None
    ahead.remember(svc, key, None)  # no D leg beside a later claim: the state is gone
    try:
        state = await pins.end(svc, key)
    except StoreError as exc:
        raise Unavailable(f"the session store is unavailable: {exc}") from None
    if state is None:
        raise NotFound(f"no conversation {conversation_id!r}", code="conversation_not_found")
    body = {"id": conversation_id, "object": "conversation.deleted", "deleted": True}
    return Response(
        msgspec.json.encode(body),
        200,
        headers={"X-Request-Id": request_id},
        media_type="application/json",
    )
