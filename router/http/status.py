"""`GET /status`: the instances by role with health and load, the session store, the model.

Public (no auth), so it shows nothing secret: no keys, no Redis URL, no conversation.
"""

from __future__ import annotations

import functools
import os
import time
from importlib import metadata
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.engines import ranks
from router.engines.dns import DnsExpander
from router.engines.pool import Instance, Role
from router.lifecycle.pin_sweep import release_delay
from router.services import Services
from sessions.store import StoreError, StoreRefused


@functools.cache
def version() -> str:
    try:
        return metadata.version("kvbaton")
    except metadata.PackageNotFoundError:
        return "unknown"


def instance_view(inst: Instance, source: str) -> dict[str, Any]:
    return {
        "url": inst.url,
        "role": inst.role,
        "healthy": inst.healthy,
        "draining": inst.draining,
        "usable": inst.usable,
        "outstanding": inst.outstanding,
        "model": inst.model,
        "block_size": inst.block_size,
        "failures": inst.failures,
        "last_error": inst.last_error,
        "started": inst.ident.started,
        "restarts": inst.ident.restarts,
        "unreachable": inst.ident.unreachable,
        "reads_paused": inst.ident.paused_for(time.monotonic()),
        "engine_requests": inst.engine_requests,
        "streams_params": inst.ident.streams_params,
        # Its vLLM version (GET /version; "" until it answers) and what the router takes from
        # it: streamed handles, the NIXL connector group it pairs within, 503 on pause, and
        # the registration generation of its latest handle (vLLM 0.33).
        "vllm": {
            "version": inst.ident.version.version,
            "streams_handles": inst.ident.streams_handles,
            "connector_group": inst.ident.version.group,
            "pause_rejects": inst.ident.version.pause_rejects,
            "registration_generation": inst.ident.registration,
            # Whether it serves /v1/responses/render (null: not asked yet; false: 403 without
            # --enable-scale-out, or no route): Responses turns verified by tokens or digests.
            "renders": inst.ident.renders,
            # Whether it serves vllm#51919's /v1/pd_kv_ready (null: not asked yet): its D legs
            # are sent beside P's (--concurrent-dispatch).
            "pd_kv_ready": inst.ident.parks,
        },
        "source": source,
        # A P's reads from D as learned (router/engines/reads.py): the fewest lacking tokens
        # it reads (0: any), and the share of a conversation's last prompt its cache keeps.
        "read_floor": inst.reads.floor,
        "kept": round(inst.reads.kept, 3),
        # A D's KV usage (0-1, -1 unknown), whether it is over the pin high-water mark, and
        # the handles on it in the pin index (-1: not swept yet): the distinct blocks of D they
        # pin (a share of D's size), their blocks summed handle by handle (a block several
        # share, once per handle) and their tokens summed (docs/metrics.md).
        "kv_usage": inst.kv_usage,
        "pin_pressure": inst.pressured,
        "pinned_handles": inst.pins,
        "pinned_blocks": inst.pinned_blocks,
        "pinned_handle_blocks": inst.pinned_handle_blocks,
        "pinned_tokens": inst.pinned_tokens,
    }


def pins_view(svc: Services) -> dict[str, Any]:
    """The release of D's pinned handles: on or off, the delay, what was released."""
    if svc.releaser is None:
        return {"release": False}
    p95 = svc.gaps.p95()
    return {
        "release": True,
        "release_after_s": round(release_delay(svc), 3),
        "inter_turn_p95_s": round(p95, 3) if p95 is not None else None,
        **svc.releaser.view(),
    }


def view(svc: Services, inst: Instance, dns: DnsExpander | None = None) -> dict[str, Any]:
    """An instance as /status shows it; `source` says whether the command line named it
    (`command-line`), one of its names resolved to it (`dns`, --resolve-dns), or the admin API."""
    settings = svc.settings
    flags = settings.prefill if inst.role == "prefill" else settings.decode
    if inst.url in flags:
        source = "command-line"
    elif dns is not None and inst.url in dns.expanded:
        source = "dns"
    else:
        source = "admin"
    out = instance_view(inst, source)
    # The KV-transfer mode, and in push mode a P's coordinates (or why they are unknown).
    out["kv"] = svc.connector.instance_view(inst)
    out["data_parallel_size"] = ranks.size_of(settings.data_parallel_size, inst)
    return out


def instances_by_role(
    svc: Services, dns: DnsExpander | None = None
) -> dict[Role, list[dict[str, Any]]]:
    return {
        role: [view(svc, i, dns) for i in svc.pool.instances(role)]
        for role in ("prefill", "decode")
    }


async def store_view(svc: Services) -> dict[str, Any]:
    """Ping the store directly (past the breaker, which an answer closes), then say whether the
    breaker is open."""
    view: dict[str, Any] = {"kind": svc.settings.session_store}
    try:
        await svc.guard.ping(svc.store)
    except StoreError as exc:
        view.update(status="refused" if isinstance(exc, StoreRefused) else "unavailable")
        view["error"] = str(exc)
    else:
        view.update(status="ok", error="")
    view["circuit_open"] = svc.guard.is_open
    view["failures"] = svc.guard.failures
    return view


async def status(request: Request) -> Response:
    svc: Services = request.app.state.services
    instances = instances_by_role(svc, request.app.state.operations.syncer.dns)
    prefill_nodes = [i["url"] for i in instances["prefill"]]
    decode_nodes = [i["url"] for i in instances["decode"]]
    body = {
        "version": version(),
        "model": svc.model,
        "block_size": svc.block_size,
        "reuse": svc.settings.reuse,
        # Sessions carry an HMAC (--session-secret; the memory store makes its own).
        "signed": bool(svc.settings.session_secrets),
        # P legs by token ids (--prefill-token-ids), and why this process stopped them if it did.
        "prefill_token_ids": {"on": svc.ids_leg_on(), "off_reason": svc.ids_leg_off},
        "stopping": svc.stopping,
        # With --workers N, one of N processes answered: the instances' health, load and the
        # breaker below are this worker's view.
        "worker": {"pid": os.getpid(), "workers": svc.settings.workers},
        "instances": instances,
        # Instances by NIXL connector group ("unknown": version not read): P/D pairs are
        # formed within a group (engines of different vLLM versions cannot move KV).
        "connector_groups": svc.pool.groups(),
        # What each engine's prefix cache holds, from its KV events; "on": false means
        # --kv-events is not set: handles are sent on every verified hit, P placed by load.
        "kv_events": svc.kv_events.view() if svc.kv_events is not None else {"on": False},
        "store": await store_view(svc),
        # The connector (--kv-connector) and its own state: MoRI-IO's announced instances.
        **svc.connector.status(),
        "pins": pins_view(svc),
        # The demo proxies' /status fields (every instance in the pool, usable or not).
        "prefill_node_count": len(prefill_nodes),
        "decode_node_count": len(decode_nodes),
        "prefill_nodes": prefill_nodes,
        "decode_nodes": decode_nodes,
    }
    return Response(msgspec.json.encode(body), 200, media_type="application/json")
