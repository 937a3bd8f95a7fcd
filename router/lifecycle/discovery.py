"""Start-up checks: every instance serves the same model; learn the KV block size."""

from __future__ import annotations

import asyncio
import logging
import re

import msgspec

from router.config import Settings
from router.connectors.select import select
from router.engines import ranks
from router.engines.client import Upstream
from router.engines.metrics_text import matches, process_started
from router.engines.pool import Instance, Pool
from router.errors import StartupError, UpstreamFailure
from router.lifecycle.advice import v1_hint, warn_v1_suffixes
from router.lifecycle.health import read_version
from router.metrics import Metrics
from router.services import Services, StoreGuard
from sessions.memory_store import MemorySessionStore

log = logging.getLogger("kvbaton.discovery")

# vLLM exports its cache config as labels of an info metric (measured on 0.32).
_BLOCK_SIZE = (
    b"vllm:cache_config_info{",
    re.compile(rb'vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"'),
)


async def inspect(svc: Services, inst: Instance, report: bool = True) -> bool:
    """Fill in the instance's model and block size; mark it unhealthy if it cannot answer
    (said in the log when `report`). Whether it answered."""
    timeout = svc.settings.connect_timeout + 5.0
    try:
        status, raw = await svc.engines.get(inst.url + "/v1/models", timeout=timeout)
        if status != 200:
            raise UpstreamFailure(f"/v1/models answered {status}")
        data = msgspec.json.decode(raw).get("data") or []
        inst.model = str(data[0]["id"]) if data else ""
        inst.max_model_len = _max_model_len(data[0]) if data else 0
        status, metrics = await svc.engines.get(inst.url + "/metrics", timeout=timeout)
    except (UpstreamFailure, msgspec.DecodeError, AttributeError, KeyError, TypeError) as exc:
        inst.healthy = False
        inst.last_error = f"check failed: {exc}"
        if report:
            hint = v1_hint(inst.url)
            log.warning(
                "%s instance %s is not answering: %s%s",
                inst.role,
                inst.url,
                exc,
                f" ({hint})" if hint else "",
            )
        return False
    match = next(matches(_BLOCK_SIZE, metrics, whole=False), None) if status == 200 else None
    inst.block_size = int(match.group(1)) if match else 0
    if status == 200:
        inst.ident.note_started(process_started(metrics))
        inst.dp_size = ranks.learned_size(metrics)
    await read_version(svc.engines, inst, timeout)
    model = svc.model or inst.model or svc.settings.model
    await svc.connector.inspect(svc.engines, inst, model, timeout)
    return True


def _max_model_len(card: dict[str, object]) -> int:
    """vLLM's model card carries the context length (`max_model_len`)."""
    value = card.get("max_model_len")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


async def discover(svc: Services, report: bool = True) -> None:
    """Check all instances; refuse to start when they serve different models. With `report`,
    log what start-up found (the pre-flight check does not: the lifespan says it, once)."""
    if report:
        warn_v1_suffixes(svc.settings)
    if not svc.settings.check_models:
        svc.model = svc.settings.model
        svc.block_size = svc.settings.block_size
        return
    instances = svc.pool.instances()
    await asyncio.gather(*(inspect(svc, inst, report) for inst in instances))
    models = {inst.model for inst in instances if inst.model}
    if svc.settings.model:
        models.add(svc.settings.model)
    if len(models) > 1:
        detail = ", ".join(f"{i.url}={i.model or '?'}" for i in instances)
        wanted = svc.settings.model
        if wanted and len(models - {wanted}) == 1:
            raise StartupError(f"--model {wanted!r}, but the instances serve: {detail}")
        raise StartupError(f"instances serve different models: {detail}")
    svc.model = models.pop() if models else ""
    # D refuses a max_tokens that leaves no room for a prompt; the router refuses it before P.
    lengths = [i.max_model_len for i in instances if i.role == "decode" and i.max_model_len]
    svc.max_model_len = min(lengths, default=0)
    sizes = {inst.block_size for inst in instances if inst.block_size}
    if svc.settings.block_size:
        svc.block_size = svc.settings.block_size
    elif len(sizes) == 1:
        svc.block_size = sizes.pop()
    elif sizes:
        raise StartupError(f"instances use different KV block sizes: {sorted(sizes)}")
    if report:
        _log_found(svc)


async def learn_late(svc: Services, inst: Instance) -> bool:
    """An instance that did not answer at start now answers its /health: learn its model and
    block size as start-up would have, and the router's own while it knows none (said in one
    line). False while it cannot serve: /v1/models not answering yet, or another model or
    block size than the router's (said, and it stays out)."""
    if not await inspect(svc, inst, report=False):
        return False
    why = ""
    if svc.model and inst.model and inst.model != svc.model:
        why = f"serves model {inst.model!r}, the router serves {svc.model!r}"
    elif svc.block_size and inst.block_size and inst.block_size != svc.block_size:
        why = f"uses KV blocks of {inst.block_size} tokens, the router {svc.block_size}"
    if why:
        inst.healthy = False
        if inst.last_error != why:
            log.warning("%s instance %s is kept out: it %s", inst.role, inst.url, why)
        inst.last_error = why
        return False
    learned = not svc.model and bool(inst.model)
    if learned:
        svc.model = inst.model
    if not svc.block_size and inst.block_size:
        svc.block_size = inst.block_size
        learned = True
    if inst.role == "decode" and inst.max_model_len:
        svc.max_model_len = min(filter(None, (svc.max_model_len, inst.max_model_len)))
    if learned:
        log.info(
            "model %r, block size %s: learned from %s instance %s, which answers now",
            svc.model,
            svc.block_size or "unknown",
            inst.role,
            inst.url,
        )
    return True


def _log_found(svc: Services) -> None:
    counts = (len(svc.settings.prefill), len(svc.settings.decode))
    if not svc.model:
        log.warning(
            "no engine answered at start (%d prefill and %d decode instances): each is probed "
            "every --health-interval and serves once it answers; the model and KV block size "
            "are learned from the first that does",
            *counts,
        )
    else:
        log.info(
            "model %r, block size %s, %d prefill and %d decode instances",
            svc.model,
            svc.block_size or "unknown",
            *counts,
        )
    _log_groups(svc)


def _log_groups(svc: Services) -> None:
    """A fleet of several vLLM connector versions (an upgrade under way) is served in groups
    that can move KV to each other: said once at start, and in /status."""
    groups = svc.pool.groups()
    if len(groups) < 2:
        return
    for name, members in sorted(groups.items()):
        log.warning(
            "connector group %s: prefill %s, decode %s (P/D pairs are formed within a group)",
            name,
            ", ".join(members["prefill"]) or "none",
            ", ".join(members["decode"]) or "none",
        )


async def preflight(settings: Settings) -> None:
    """The start-up check alone, before the server binds, so a bad deployment fails with one
    clear line instead of a lifespan traceback."""
    upstream = Upstream(settings)
    await upstream.open()
    try:
        pool = Pool(settings.prefill, settings.decode, settings.unhealthy_after)
        guard = StoreGuard(0.0)
        svc = Services(
            settings,
            upstream,
            pool,
            MemorySessionStore(),
            guard,
            Metrics(pool, lambda: False),
            select(settings),
        )
        await discover(svc, report=False)
    finally:
        await upstream.close()
