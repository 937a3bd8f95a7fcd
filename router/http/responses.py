"""`GET /v1/responses/{id}`, its `input_items`, and `DELETE /v1/responses/{id}`: the router's
stored responses in OpenAI's shapes, scoped to the caller's tenant (its bearer token or
--tenant-header) like its turns: another tenant's response is not found."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.errors import BadRequest, Unavailable, UnknownResponse
from router.services import Services
from router.turn import pins
from router.turn.responses_chain import load
from router.turn.responses_input import response_id
from router.turn.run import new_request_id
from router.turn.tenant import tenant_of_headers
from sessions.keys import conversation_key, response_key
from sessions.responses_store import StoredResponse, unseal
from sessions.store import StoreError

# OpenAI's list defaults and bounds (`GET /v1/responses/{id}/input_items`).
DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def _json(body: Any, request_id: str) -> Response:
    return Response(
        msgspec.json.encode(body),
        200,
        headers={"X-Request-Id": request_id},
        media_type="application/json",
    )


def _asked(request: Request) -> tuple[Services, str, str]:
    """(services, tenant, response id) of a request, its request id set for its errors."""
    svc: Services = request.app.state.services
    request.state.request_id = new_request_id()
    rid = response_id(request.path_params["response_id"], "response_id")
    return svc, tenant_of_headers(request.headers, svc.settings.tenant_header), rid


def _not_found(rid: str) -> UnknownResponse:
    return UnknownResponse(f"Response with id '{rid}' not found.", code="response_not_found")


async def _found(svc: Services, tenant: str, rid: str) -> StoredResponse:
    record = await load(svc, tenant, rid)
    if record is None:
        raise _not_found(rid)
    return record


async def get(request: Request) -> Response:
    """The response object as it finished (`store: true`, `previous_response_id` filled in)."""
    svc, tenant, rid = _asked(request)
    record = await _found(svc, tenant, rid)
    return _json(record.response, request.state.request_id)


async def input_items(request: Request) -> Response:
    """Every input item the response was generated from (the chain's earlier inputs and
    outputs included), as OpenAI's `ResponseItemList`: `order` (desc by default), `limit`
    (1-100, 20), `after` (an item id)."""
    svc, tenant, rid = _asked(request)
    record = await _found(svc, tenant, rid)
    items = [_item(item, i, rid) for i, item in enumerate(record.input)]
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("'order' must be 'asc' or 'desc'", param="order")
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BadRequest(f"no input item {after!r} in response '{rid}'", param="after")
        items = items[ids.index(after) + 1 :]
    limit = _limit(query.get("limit"))
    page = items[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
    return _json(body, request.state.request_id)


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise BadRequest(f"'limit' must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return int(raw)


def _item(item: Any, index: int, rid: str) -> dict[str, Any]:
    """An input item as OpenAI lists it: an id, and a message's content as parts."""
    out = dict(item) if isinstance(item, dict) else {"type": "unknown"}
    out.setdefault("id", f"item_{index}_{rid}")
    if "role" in out and out.get("type", "message") == "message":
        out["type"] = "message"
        out.setdefault("status", "completed")
        content = out.get("content")
        if isinstance(content, str):
            kind = "output_text" if out["role"] == "assistant" else "input_text"
            part: dict[str, Any] = {"type": kind, "text": content}
            if kind == "output_text":
                part["annotations"] = []
            out["content"] = [part]
    return out


async def delete(request: Request) -> Response:
    """Forget the response; when its turn left the handle of a conversation the router made
    for its chain (not one the client named) and nothing has read it since, release what D
    pins for it too (docs/responses.md)."""
    svc, tenant, rid = _asked(request)
    try:
        key = response_key(tenant, rid)
        value = await svc.guard.call(lambda: svc.responses.delete(key))
    except ValueError:
        raise _not_found(rid) from None
    except StoreError as exc:
        raise Unavailable(f"the session store is unavailable: {exc}") from None
    record = unseal(svc.settings.session_secrets, key, value) if value is not None else None
    if record is None:
        raise _not_found(rid)
    if record.conversation and not record.named and record.turn:
        try:
            conversation = conversation_key(tenant, record.conversation)
            await pins.release_turn(svc, conversation, record.turn)
        except (ValueError, StoreError):
            pass  # D's own TTL frees it
    body = {"id": rid, "object": "response.deleted", "deleted": True}
    return _json(body, request.state.request_id)
