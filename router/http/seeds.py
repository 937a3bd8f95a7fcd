"""The demo proxies' conventions (vLLM's disagg_proxy_demo.py, Mooncake's proxy), so their
users' scripts keep working: `POST /instances/add` with `{"type", "instance"}` and X-API-Key."""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.config import base_url
from router.engines.pool import Role
from router.errors import BadRequest, NotFound, Unauthorized
from router.http.admin import add
from router.http.status import view
from router.services import Services


class SeedInstance(msgspec.Struct):
    """The seeds' body: `{"type": "prefill", "instance": "host:port"}`; in push mode a P may
    come with its coordinates (`engine_id`, `side_channel_host`, `side_channel_port`,
    `tp_size`, `pp_size`), else the router probes it for them."""

    type: Role
    instance: str
    kv_events: str = ""  # kvbaton's addition: the engine's KV-events `ENDPOINT[,REPLAY]`
    engine_id: str | None = None
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    tp_size: int = 1
    pp_size: int = 1

    def extras(self) -> dict[str, Any]:
        """The connector's fields (push coordinates), when any was given."""
        given = (self.engine_id, self.side_channel_host, self.side_channel_port)
        if all(v is None for v in given):
            return {}
        return {
            "engine_id": self.engine_id,
            "side_channel_host": self.side_channel_host,
            "side_channel_port": self.side_channel_port,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
        }


def check_api_key(key: str, sent: str | None) -> None:
    """404 while no key is configured; 401 unless X-API-Key matches (constant time)."""
    if not key:
        raise NotFound(
            "POST /instances/add is disabled: set ADMIN_API_KEY (or --admin-api-key, --admin-key)",
            code="admin_disabled",
        )
    if sent is None or not hmac.compare_digest(sent.strip().encode(), key.encode()):
        raise Unauthorized(
            "missing or wrong API key: send X-API-Key: <ADMIN_API_KEY>", code="invalid_api_key"
        )


async def add_instance(request: Request) -> Response:
    """The admin add (validated against /v1/models, recorded in the registry), seed-shaped."""
    svc: Services = request.app.state.services
    settings = svc.settings
    check_api_key(settings.admin_api_key or settings.admin_key, request.headers.get("x-api-key"))
    try:
        body = msgspec.json.decode(await request.body(), type=SeedInstance)
    except msgspec.DecodeError as exc:
        raise BadRequest(
            f'expected {{"type": "prefill"|"decode", "instance": "host:port"}}: {exc}'
        ) from None
    url = base_url(body.instance)
    if not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
        raise BadRequest(f"instance must be host:port or a base URL, not {body.instance!r}")
    extras = body.extras()
    if extras:
        try:
            svc.connector.seed(url, body.type, extras)
        except ValueError as exc:
            raise BadRequest(str(exc), param="engine_id") from None
    added, inst = await add(svc, request.app.state.operations, url, body.type, body.kv_events)
    out = {
        "message": f"{'added' if added else 'already serving'} {body.type} instance {url}",
        "status": "added" if added else "active",
        "instance": view(svc, inst),
    }
    return Response(msgspec.json.encode(out), 201 if added else 200, media_type="application/json")
