"""7, faults: the pins D holds that the router does not know of (orphans) after a fault.

Every pin D makes for a turn must end in a committed state the router's pin index knows, or in
a release. Each fault runs on a fresh stack (a P, a D, a private Redis, kvbaton with releases
on) under a load of conversations.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.error
from collections.abc import Callable
from typing import Any

import redis

from bench.pins import ROUTER_ARGS, decoder_pins, stack
from bench.plan import Plan
from bench.stack import LoadGen, Tick, another_router
from harness.chat import get_json
from harness.stack import Stack, argv_of
from sessions.keys import pins_key

REDIS_PAUSE_S = 3.0
COPIES = 4
TURNS = 3
SETTLE_S = 5.0  # issue 48: D's pins equal the router's count within 5 s of the fault
SWEEP_S = 1.5  # the router counts its pin index once a second (lifecycle/pin_sweep.py)
# The bots' pause between turns (pins_mixed.KINDS["scripted"]); the kill meets a closed loop.
THINK = {"dist": "uniform", "lo": 1.0, "hi": 3.0}

Fault = Callable[[Stack], dict[str, Any]]


def steps(_: Plan) -> int:
    return len(FAULTS)


def job(plan: Plan, urls: list[str], *, copies: int = 1, pause: bool = True) -> dict[str, Any]:
    """pins_fault_convs conversations of TURNS turns, all at once, each turn `copies` times."""
    return {
        "kind": "conversations",
        "target": {"mode": "router", "urls": urls},
        "n": plan.pins_fault_convs,
        "concurrency": plan.pins_fault_convs,
        "turns": TURNS,
        "system_words": (200, 600),
        "user_words": (20, 60),
        "output_tokens": (20, 60),
        "deadline_s": 60.0,
        "request_timeout_s": plan.pins_timeout_s,
        "seed": 730,
        "copies": copies,
        **({"think": THINK} if pause else {}),
    }


def pause_redis(st: Stack) -> dict[str, Any]:
    """SIGSTOP the stack's redis-server for REDIS_PAUSE_S, then SIGCONT (also on an error)."""
    assert st.redis_proc is not None
    st.redis_proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(REDIS_PAUSE_S)
    finally:
        st.redis_proc.send_signal(signal.SIGCONT)
    return {"paused_s": REDIS_PAUSE_S}


def kill_router(st: Stack) -> dict[str, Any]:
    """SIGKILL the router once D runs turns (up to 10 s); what D ran at that moment."""
    running, deadline = 0, time.monotonic() + 10.0
    while running == 0 and time.monotonic() < deadline:
        running = int(get_json(st.d.url + "/sim/state", timeout=2)["running"])
        time.sleep(0.02 if running == 0 else 0.0)
    st.router.proc.kill()
    st.router.proc.wait(5)
    return {"d_running_at_kill": running}


def under(
    lg: LoadGen, spec: dict[str, Any], st: Stack, at: float, fault: Fault | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the job; `fault` on a thread `at` seconds into it. (result, what the fault said)."""
    said: dict[str, Any] = {}

    def strike() -> None:
        try:
            said.update(fault(st) if fault else {}, fired=True)
        except Exception as exc:  # reported with the arm's figures
            said["error"] = f"{type(exc).__name__}: {exc}"

    timer = threading.Timer(at, strike)
    if fault is not None:
        timer.start()
    try:
        return lg.run(spec, timeout=spec["deadline_s"] + 30.0), said
    finally:
        timer.cancel()
        if fault is not None:
            timer.join()


def router_count(status: dict[str, Any]) -> int | None:
    """The handles the router's pin index holds on every D (None: a D not counted yet)."""
    counts = [i["pinned_handles"] for i in status["instances"]["decode"]]
    return None if any(c < 0 for c in counts) else sum(counts)


def indexed(redis_url: str, d_urls: list[str]) -> list[str | None]:
    """Per entry of the router's pin index on these D: the D request id of the handle its
    conversation holds (None: it holds none, a turn took it)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5, decode_responses=True)
    found: list[str | None] = []
    with contextlib.closing(client):
        for url in d_urls:
            for key in client.zrange(pins_key(url), 0, -1):
                raw = client.hget(str(key), "kv_transfer_params")
                found.append(json.loads(raw).get("remote_request_id") if raw else None)
    return found


def orphans(
    d_states: list[dict[str, Any]], status: dict[str, Any], index: list[str | None]
) -> dict[str, Any]:
    """D's pins less the router's count; and by request id, D's pins no entry of the index
    names (`unknown`) and the entries that name no pin on D (`stale`)."""
    pinned = {p["request_id"] for s in d_states for p in decoder_pins(s)}
    counted = router_count(status)
    named = {rid for rid in index if rid is not None}
    d_pins = sum(len(decoder_pins(s)) for s in d_states)
    return {
        "d_pins": d_pins,
        "router_pins": counted,
        "orphans": None if counted is None else d_pins - counted,
        "unknown": len(pinned - named),
        "stale": len(index) - len(pinned & named),
    }


def measure(st: Stack, router_url: str) -> dict[str, Any]:
    """orphans() now, once the router has counted every D (a fresh one sweeps within 1 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            status = get_json(router_url + "/status", timeout=5)
        except (TimeoutError, urllib.error.URLError):
            status = {"instances": {"decode": [{"pinned_handles": -1}]}}
        if router_count(status) is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    states = [get_json(d.url + "/sim/state", timeout=5) for d in st.ds]
    assert st.redis_url is not None
    return orphans(states, status, indexed(st.redis_url, [d.url for d in st.ds]))


def strike(plan: Plan, lg: LoadGen, fault: Fault | None, replicas: int = 1) -> dict[str, Any]:
    """The load on a fresh stack with `fault` in it (None: every turn sent COPIES times across
    the replicas); the orphans after a sweep and SETTLE_S later, through a fresh router on the
    same Redis where the fault killed one."""
    with stack(plan, *[[]] * replicas) as st, contextlib.ExitStack() as fresh:
        copies = COPIES if fault is None else 1
        spec = job(plan, st.router_urls, copies=copies, pause=fault is not kill_router)
        res, said = under(lg, spec, st, 0.0 if fault is None else plan.pins_fault_at_s, fault)
        url, commands = st.url, dict(st.commands)
        if fault is kill_router:
            r = fresh.enter_context(another_router(st, *ROUTER_ARGS, name="pins-fresh-router"))
            url, commands["router0 (fresh)"] = r.url, argv_of(r.proc)
        time.sleep(SWEEP_S)
        after = measure(st, url)
        time.sleep(SETTLE_S)
        turns = res["turns"]
        return {
            "turns": len(turns),
            "failed": sum(not t["ok"] for t in turns),
            "errors": sorted({t["error"] for t in turns if t["error"]})[:3],
            "fault": said,
            "after": after,
            "after_settle": measure(st, url),
            "commands": commands,
        }


FAULTS: dict[str, Callable[[Plan, LoadGen], dict[str, Any]]] = {
    f"Redis paused {REDIS_PAUSE_S:g} s": lambda plan, lg: strike(plan, lg, pause_redis),
    f"{COPIES}x duplicate turns, 2 routers": lambda plan, lg: strike(plan, lg, None, 2),
    "router killed mid-turn": lambda plan, lg: strike(plan, lg, kill_router),
}


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"arms": {}, "settle_s": SETTLE_S}
    for name, arm in FAULTS.items():
        tick(f"pins: {name}")
        out["arms"][name] = arm(plan, lg)
    return out
