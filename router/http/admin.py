"""The admin API under `/admin/`: add, drain, remove and list instances; look up, delete and
list conversations. Enabled by `--admin-key`; `Authorization: Bearer <key>` on every call."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import msgspec
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from router.engines.pool import Instance, Role
from router.errors import (
    BadRequest,
    ConfigError,
    Conflict,
    NotFound,
    Unauthorized,
    Unavailable,
    Unprocessable,
)
from router.http.status import instances_by_role, view
from router.lifecycle import registry as reg
from router.services import Services
from router.turn import pins
from router.turn.tenant import DEFAULT_TENANT, validate_conversation_id
from sessions.admin_ops import ConversationIndex
from sessions.keys import conversation_key
from sessions.model import SessionState
from sessions.registry_store import Entry
from sessions.store import StoreError

log = logging.getLogger("kvbaton.admin")

MAX_PAGE = 1000


class InstanceBody(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    role: Role | None = None
    kv_events: str = ""  # the engine's KV-events endpoint, `ENDPOINT[,REPLAY]` (add only)


@dataclass
class Operations:
    """What the admin API works on, built by the app's lifespan over its sessions.Backend (the
    registry and the conversation index share the session store's Redis client)."""

    syncer: reg.Syncer
    conversations: ConversationIndex | None


def authorize(key: str, header: str | None) -> None:
    """404 while the admin API is disabled; 401 unless the Bearer key matches (constant time)."""
    if not key:
        raise NotFound(
            "the admin API is disabled: start the router with --admin-key (KVBATON_ADMIN_KEY)",
            code="admin_disabled",
        )
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized(
            "missing or wrong admin key: send Authorization: Bearer <KVBATON_ADMIN_KEY>",
            code="invalid_admin_key",
        )


class AdminGate:
    """Wraps the admin routes: nothing under /admin/ runs before `authorize` passes."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            authorize(self.key, Headers(scope=scope).get("authorization"))
        await self.app(scope, receive, send)


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def _context(request: Request) -> tuple[Services, Operations]:
    return request.app.state.services, request.app.state.operations


def _url(raw: str) -> str:
    url = raw.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
        raise BadRequest(f"url must be an http:// or https:// base URL, not {raw!r}", param="url")
    return url


async def _instance_body(request: Request, *, query: bool = False) -> InstanceBody:
    raw = await request.body()
    if not raw and query and "url" in request.query_params:
        try:
            return msgspec.convert(dict(request.query_params), InstanceBody)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"query: {exc}") from None
    try:
        return msgspec.json.decode(raw, type=InstanceBody)
    except msgspec.DecodeError as exc:
        raise BadRequest(f'expected {{"url": "http://...", "role": ...}}: {exc}') from None


def _find(svc: Services, url: str, role: Role | None) -> Instance:
    roles: tuple[Role, ...] = (role,) if role else ("prefill", "decode")
    found = [i for r in roles if (i := svc.pool.find(r, url)) is not None]
    if not found:
        raise NotFound(f"no instance {url} in the pool", code="instance_not_found")
    if len(found) > 1:
        raise BadRequest(f"{url} is both a prefill and a decode instance: give a role")
    return found[0]


async def _record(ops: Operations, url: str, entry: Entry) -> None:
    try:
        await ops.syncer.registry.put(url, entry)
    except StoreError as exc:
        raise Unavailable(f"the instance registry is unavailable, nothing changed: {exc}") from None


async def list_instances(request: Request) -> Response:
    svc, ops = _context(request)
    try:
        entries = {u: msgspec.to_builtins(e) for u, e in (await ops.syncer.registry.load()).items()}
        error = ""
    except StoreError as exc:
        entries, error = {}, str(exc)
    return _json(
        {
            "instances": instances_by_role(svc, ops.syncer.dns),
            "registry": entries,
            "registry_error": error,
        }
    )


async def add(
    svc: Services, ops: Operations, url: str, role: Role, kv_events: str = ""
) -> tuple[bool, Instance]:
    """Add (True) or reactivate (False) an instance, validated against its /v1/models (as
    vLLM's XpYd proxy does) before it joins, and recorded in the registry; its KV events
    are read from `kv_events` (`ENDPOINT[,REPLAY]`), else as the command line says."""
    try:
        reg.check_events_spec(url, kv_events)
    except ConfigError as exc:
        raise BadRequest(str(exc).replace("--kv-events", "kv_events"), param="kv_events") from None
    async with ops.syncer.lock:
        other = svc.pool.find("decode" if role == "prefill" else "prefill", url)
        if other is not None:
            raise Conflict(f"{url} is already a {other.role} instance: remove it first")
        inst = svc.pool.find(role, url)
        if inst is not None:
            await _record(ops, url, reg.entry(role, "active", kv_events=kv_events))
            inst.draining = False
            reg.follow_events(svc, url, kv_events)
            return False, inst
        inst = Instance(url, role)
        reason = await reg.admit(svc, inst)
        if reason:
            raise Unprocessable(reason, param="url", code="instance_refused")
        await _record(ops, url, reg.entry(role, "active", kv_events=kv_events))
        svc.pool.add(inst)
        reg.follow_events(svc, url, kv_events)
    log.info("admin: added %s instance %s", role, url)
    return True, inst


async def add_instance(request: Request) -> Response:
    svc, ops = _context(request)
    body = await _instance_body(request)
    url = _url(body.url)
    if body.role is None:
        raise BadRequest("role is required: 'prefill' or 'decode'", param="role")
    added, inst = await add(svc, ops, url, body.role, body.kv_events)
    body_out = {"status": "added" if added else "active", "instance": view(svc, inst)}
    return _json(body_out, 201 if added else 200)


async def drain_instance(request: Request) -> Response:
    """No new turns go to it; turns in flight finish. POST /admin/instances again to undo."""
    svc, ops = _context(request)
    body = await _instance_body(request)
    async with ops.syncer.lock:
        inst = _find(svc, _url(body.url), body.role)
        await _record(ops, inst.url, reg.entry(inst.role, "draining"))
        inst.draining = True
    log.info("admin: draining %s instance %s", inst.role, inst.url)
    return _json({"status": "draining", "instance": view(svc, inst)})


async def remove_instance(request: Request) -> Response:
    """Out of the pool at once; turns already on it finish (they hold their instance)."""
    svc, ops = _context(request)
    body = await _instance_body(request, query=True)
    async with ops.syncer.lock:
        inst = _find(svc, _url(body.url), body.role)
        await _record(ops, inst.url, reg.entry(inst.role, "removed"))
        svc.pool.remove(inst)  # turns already on it finish
        await reg.forget_events(svc, inst.url)
    log.info("admin: removed %s instance %s (%d in flight)", inst.role, inst.url, inst.outstanding)
    return _json({"status": "removed", "instance": view(svc, inst)})


def _key(request: Request) -> tuple[str, str, str]:
    conversation_id = validate_conversation_id(request.path_params["conversation_id"])
    tenant = request.query_params.get("tenant") or DEFAULT_TENANT
    try:
        return tenant, conversation_id, conversation_key(tenant, conversation_id)
    except ValueError as exc:
        raise BadRequest(str(exc), param="tenant") from None


def conversation_view(state: SessionState, now: float) -> dict[str, Any]:
    """The state without its handle: only whether one exists, for how many tokens, until when."""
    has_handle = bool(state.kv_transfer_params)
    return {
        "turn": state.turn,
        "api": state.api,
        "prefill": state.prefill,
        "decode": state.decode,
        "decode_engine_id": state.decode_engine_id,
        "decode_started": state.decode_started,
        "handle": {
            "present": has_handle,
            "tokens": state.token_count,
            "expires_at": state.handle_expires_at if has_handle else None,
            "expires_in_s": round(state.handle_expires_at - now, 3) if has_handle else None,
            "claimed_by": state.inflight,
        },
        "no_handle_reason": state.no_handle_reason,
        "prefix_len": state.prefix_len,
        "block_size": state.block_size,
        "verified_blocks": len(state.block_digests),
        "created_at": state.created_at,
        "updated_at": state.updated_at,
    }


async def get_conversation(request: Request) -> Response:
    svc, ops = _context(request)
    tenant, conversation_id, key = _key(request)
    try:
        state = await svc.store.get(key)
        ttl = await ops.conversations.ttl(key) if state and ops.conversations else None
    except StoreError as exc:
        raise Unavailable(f"the session store is unavailable: {exc}") from None
    if state is None:
        raise NotFound(f"no conversation {conversation_id!r} for tenant {tenant!r}")
    view = conversation_view(state, svc.clock())
    return _json(
        {"conversation_id": conversation_id, "tenant": tenant, "key": key, "ttl_s": ttl} | view
    )


async def delete_conversation(request: Request) -> Response:
    """Forget it: its next turn is a miss (no-session); its handle is released (D frees it)."""
    svc, _ = _context(request)
    tenant, conversation_id, key = _key(request)
    try:
        deleted = await pins.end(svc, key) is not None
    except StoreError as exc:
        raise Unavailable(f"the session store is unavailable: {exc}") from None
    if not deleted:
        raise NotFound(f"no conversation {conversation_id!r} for tenant {tenant!r}")
    return _json(
        {"deleted": True, "conversation_id": conversation_id, "tenant": tenant, "key": key}
    )


async def _page(request: Request, decode: str) -> Response:
    _, ops = _context(request)
    if ops.conversations is None:
        raise Unavailable("this session store cannot list conversations")
    params = request.query_params
    try:
        count = int(params.get("count", "100"))
        cursor = str(int(params.get("cursor", "0")))
    except ValueError:
        raise BadRequest("cursor and count must be integers") from None
    if not 1 <= count <= MAX_PAGE or cursor.startswith("-"):
        raise BadRequest(f"count must be 1..{MAX_PAGE} and cursor >= 0", param="count")
    try:
        page = await ops.conversations.list(decode, cursor, count)
    except StoreError as exc:
        raise Unavailable(f"the session store is unavailable: {exc}") from None
    return _json({"decode": decode, "complete": page.cursor == "0"} | msgspec.to_builtins(page))


async def list_conversations(request: Request) -> Response:
    """`?decode=URL` (optional), `cursor` (0 to start), `count`: one SCAN page per call."""
    decode = request.query_params.get("decode", "")
    return await _page(request, _url(decode) if decode else "")


async def list_decode_conversations(request: Request) -> Response:
    return await _page(request, _url(unquote(request.path_params["url"])))


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    raise NotFound(f"no admin endpoint {scope.get('method', '')} {scope.get('path', '')}")


def admin_app(key: str) -> ASGIApp:
    """The /admin/ sub-application (mounted by the app factory)."""
    routes = [
        Route("/instances", list_instances, methods=["GET"]),
        Route("/instances", add_instance, methods=["POST"]),
        Route("/instances", remove_instance, methods=["DELETE"]),
        Route("/instances/drain", drain_instance, methods=["POST"]),
        Route("/conversations", list_conversations, methods=["GET"]),
        Route("/conversations/{conversation_id:path}", get_conversation, methods=["GET"]),
        Route("/conversations/{conversation_id:path}", delete_conversation, methods=["DELETE"]),
        Route("/decode/{url:path}/conversations", list_decode_conversations, methods=["GET"]),
    ]
    return AdminGate(Router(routes=routes, default=_not_found), key)
