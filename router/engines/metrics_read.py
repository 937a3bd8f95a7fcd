"""An engine's `/metrics` read on demand: its process start (a restart), its scheduler's
requests, KV usage and sleep, and whether it is reachable (the text itself: metrics_text.py)."""

from __future__ import annotations

import time

from router.engines.client import EngineClient
from router.engines.metrics_text import engine_requests, kv_discarded, kv_usage, process_started
from router.engines.pool import Instance
from router.errors import UpstreamFailure


async def read_started(engines: EngineClient, inst: Instance, timeout: float) -> None:
    """Sample the instance's process start time. A read that cannot connect marks it
    unreachable until one connects; other failures change nothing (live traffic and /health
    judge health)."""
    try:
        status, metrics = await engines.get(inst.url + "/metrics", timeout=timeout)
    except UpstreamFailure as exc:
        if not exc.reached:
            inst.ident.note_reachable(False, str(exc))
        return
    if status == 200:
        inst.ident.note_started(process_started(metrics))
        inst.engine_requests = engine_requests(metrics)
        inst.note_kv_usage(kv_usage(metrics))
        inst.ident.note_sleep(kv_discarded(metrics), time.time())  # the sessions' clock
    inst.ident.note_reachable(True)
