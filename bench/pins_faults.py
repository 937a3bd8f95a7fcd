"""7, faults: the pins D holds that the router does not know of (orphans) after a fault.

Every pin D makes for a turn must end in a committed state the router's pin index knows or in
a release (docs/architecture.md, "Pinned handles"). Each fault runs on a fresh stack (a P, a D,
a private Redis, kvbaton with releases on) under a load of conversations: Redis paused for
3 s (SIGSTOP, then SIGCONT, of the bench's redis-server) while turns run; every turn sent 4
times at once (the same conversation id and body) across two router replicas on one Redis;
the router SIGKILLed while D runs turns, then a fresh router on the same Redis. Orphans = the
pins D lists (`/sim/state`, kind "decoder") minus the handles the router's `/status` counts on
D (its pin index), once the load is over and again SETTLE_S later. A count can hide a pin
behind an entry that names none, so the pins are also matched by D's request id against the
handles the index's conversations hold in Redis (the key layout is public: sessions/keys.py).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from bench.pins import ROUTER_ARGS, Tick, decoder_pins, stack
from bench.plan import Plan
from bench.stack import LoadGen, another_router
from bench.stats import table
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
    n = plan.pins_fault_convs
    return {
        "kind": "conversations",
        "target": {"mode": "router", "urls": urls},
        "n": n,
        "concurrency": n,
        "turns": TURNS,
        "system_words": (200, 600),
        "user_words": (20, 60),
        "output_tokens": (20, 60),
        "stream": True,
        "deadline_s": 60.0,
        "request_timeout_s": plan.pins_timeout_s,
        "seed": 730,
        "copies": copies,
        **({"think": THINK} if pause else {}),
    }


def pause_redis(st: Stack) -> dict[str, Any]:
    """SIGSTOP the stack's redis-server for REDIS_PAUSE_S, then SIGCONT (also on an error)."""
    proc = st.redis_proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(REDIS_PAUSE_S)
    finally:
        proc.send_signal(signal.SIGCONT)
    return {"paused_s": REDIS_PAUSE_S}


def kill_router(st: Stack) -> dict[str, Any]:
    """SIGKILL the router once D runs turns (up to 10 s); what D ran at that moment."""
    running, deadline = 0, time.monotonic() + 10.0
    while running == 0 and time.monotonic() < deadline:
        running = int(get_json(st.d.url + "/sim/state", timeout=2)["running"])
        if running == 0:
            time.sleep(0.02)
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
            said.update(fault(st) if fault else {})
            said["fired"] = True
        except Exception as exc:  # reported with the arm's figures
            said["error"] = f"{type(exc).__name__}: {exc}"

    timer = threading.Timer(at, strike)
    if fault is not None:
        timer.start()
    try:
        res = lg.run(spec, timeout=spec["deadline_s"] + 30.0)
    finally:
        timer.cancel()
        if fault is not None:
            timer.join()
    return res, said


def router_count(status: dict[str, Any]) -> int | None:
    """The handles the router's pin index holds on every D (None: a D not counted yet)."""
    counts = [i["pinned_handles"] for i in status["instances"]["decode"]]
    return None if any(c < 0 for c in counts) else sum(counts)


def indexed(redis_url: str, d_urls: list[str]) -> list[str | None]:
    """Per entry of the router's pin index on these D: the D request id of the handle its
    conversation holds (None: it holds none, a turn took it)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5, decode_responses=True)
    found: list[str | None] = []
    try:
        for url in d_urls:
            for key in client.zrange(pins_key(url), 0, -1):
                raw = client.hget(str(key), "kv_transfer_params")
                found.append(json.loads(raw).get("remote_request_id") if raw else None)
    finally:
        client.close()
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


def settle(st: Stack, router_url: str) -> dict[str, Any]:
    """orphans after a sweep, and again SETTLE_S later."""
    time.sleep(SWEEP_S)
    after = measure(st, router_url)
    time.sleep(SETTLE_S)
    return {"after": after, "after_settle": measure(st, router_url)}


def summary(res: dict[str, Any], said: dict[str, Any]) -> dict[str, Any]:
    turns = res["turns"]
    return {
        "turns": len(turns),
        "ok": sum(t["ok"] for t in turns),
        "failed": sum(not t["ok"] for t in turns),
        "reuse": dict(Counter(t["reuse"] for t in turns if t["ok"])),
        "errors": sorted({t["error"] for t in turns if t["error"]})[:3],
        "fault": said,
    }


def redis_paused(plan: Plan, lg: LoadGen) -> dict[str, Any]:
    with stack(plan, []) as st:
        res, said = under(lg, job(plan, st.router_urls), st, plan.pins_fault_at_s, pause_redis)
        return {**summary(res, said), **settle(st, st.url), "routers": 1, "commands": st.commands}


def duplicated(plan: Plan, lg: LoadGen) -> dict[str, Any]:
    with stack(plan, [], []) as st:  # two replicas on one Redis, the copies shared out
        res, said = under(lg, job(plan, st.router_urls, copies=COPIES), st, 0.0, None)
        return {**summary(res, said), **settle(st, st.url), "routers": 2, "commands": st.commands}


def router_killed(plan: Plan, lg: LoadGen) -> dict[str, Any]:
    with stack(plan, []) as st:
        spec = job(plan, st.router_urls, pause=False)
        res, said = under(lg, spec, st, plan.pins_fault_at_s, kill_router)
        with another_router(st, *ROUTER_ARGS, name="pins-fresh-router") as fresh:
            commands = {**st.commands, "router0 (fresh)": argv_of(fresh.proc)}
            return {
                **summary(res, said),
                **settle(st, fresh.url),
                "routers": 1,
                "commands": commands,
            }


FAULTS: dict[str, Callable[[Plan, LoadGen], dict[str, Any]]] = {
    f"Redis paused {REDIS_PAUSE_S:g} s": redis_paused,
    f"{COPIES}x duplicate turns, 2 routers": duplicated,
    "router killed mid-turn": router_killed,
}


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"arms": {}, "settle_s": SETTLE_S}
    for name, arm in FAULTS.items():
        tick(f"pins: {name}")
        out["arms"][name] = arm(plan, lg)
    return out


def _count(x: dict[str, Any]) -> str:
    if x["orphans"] is None:
        return f"n/a ({x['d_pins']} on D, the router had not counted)"
    return f"**{x['orphans']}** ({x['d_pins']} - {x['router_pins']})"


def _by_id(x: dict[str, Any]) -> str:
    return f"{x['unknown']} / {x['stale']}"


def _detail(arm: dict[str, Any]) -> str:
    fault = arm["fault"]
    if "error" in fault:
        return f"the fault failed: `{fault['error']}`"
    if "d_running_at_kill" in fault:
        return f"D ran {fault['d_running_at_kill']} turns at the kill"
    return ", ".join(f"`{k}` {v}" for k, v in sorted(arm["reuse"].items())) or "no turn answered"


def section(res: dict[str, Any] | None, plan: Plan) -> list[str]:
    if not res:
        return []
    lines = [
        "### Faults: pins D holds that the router does not know of",
        "",
        f"Each fault on a fresh stack (one P, one D of {plan.pins_blocks:,} blocks, a private "
        f"Redis, kvbaton with releases on) under {plan.pins_fault_convs} conversations of "
        f"{TURNS} turns at once, 1-3 s between turns (none for the kill: every conversation "
        f"has a turn in flight). Redis is paused for {REDIS_PAUSE_S:g} s from "
        f"{plan.pins_fault_at_s:g} s into the load; "
        f"duplicates send every turn {COPIES} times at once across two replicas on one Redis; "
        "the kill is a SIGKILL once D runs turns, then a fresh router on the same Redis. "
        "Orphans = D's pins (`/sim/state`, kind `decoder`) - the handles the router's "
        f"`/status` counts on D, {SWEEP_S:g} s after the load (one sweep) and "
        f"{res['settle_s']:g} s later; 0 is the invariant. By id: D's pins matched by request "
        "id against the handles the index's conversations hold in Redis (a count can hide an "
        "orphan behind an entry whose handle a turn took and never replaced).",
        "",
    ]
    rows = []
    for name, arm in res["arms"].items():
        rows.append(
            [
                name,
                str(arm["routers"]),
                f"{arm['turns']} ({arm['failed']})",
                _count(arm["after"]),
                _count(arm["after_settle"]),
                _by_id(arm["after_settle"]),
                _detail(arm),
            ]
        )
    header = ["fault", "routers", "turns (failed)", "orphans after (D - router)"]
    later = f"orphans {res['settle_s']:g} s later"
    by_id = "then by id: D's pins no entry names / entries naming no pin"
    lines += table([*header, later, by_id, "turns' outcomes"], rows)
    return lines
