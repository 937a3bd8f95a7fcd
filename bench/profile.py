"""5. Where the router's CPU goes: py-spy samples of the router process under load, the
idle ones (the event loop waiting in epoll) dropped: shares of the router's busy time."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import overhead
from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, timed
from bench.stats import fmt
from harness.stack import Stack

# A sample is charged to the innermost frame of a known group (a stdlib frame such as
# asyncio's socket write to its caller); the shares add up to 100%.
GROUPS = (
    ("SSE relay, capture (sse.py, strip.py)", ("router/turn/sse.py", "router/turn/strip.py")),
    ("session store client (redis-py)", ("redis/",)),
    ("session model, digests (sessions/)", ("sessions/",)),
    ("router turn logic (other router/ modules)", ("router/",)),
    ("upstream HTTP client (aiohttp)", ("aiohttp/",)),
    ("HTTP server (hypercorn, h11)", ("hypercorn/", "h11/")),
    ("Starlette (and anyio)", ("starlette/", "anyio/")),
    ("logging", ("logging/",)),
)
# On every stack (the process entry and the server loop): never a sample's group.
ENTRY = ("router/__main__.py", "router/cli.py", "router/http/server.py")
IDLE_GROUP = "event loop and stdlib only"
IDLE_LEAF = "EpollSelector.select ("  # the loop waiting in epoll_wait


def frame_path(frame: str) -> str:
    """'func (pkg/mod.py:12)' -> 'pkg/mod.py' (py-spy shortens paths to the package)."""
    return frame.rpartition(" (")[2].rstrip(")").rsplit(":", 1)[0]


def group_of(frames: list[str]) -> str:
    for path in (frame_path(f) for f in reversed(frames)):
        for group, prefixes in GROUPS:
            if path not in ENTRY and any(f"/{p}" in f"/{path}" for p in prefixes):
                return group
    return IDLE_GROUP


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def available() -> bool:
    return py_spy() is not None


def parse(text: str) -> dict[str, Any]:
    """Busy and idle sample counts, and each group's exclusive share of the busy ones."""
    groups: Counter[str] = Counter()
    idle = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_LEAF):
            idle += int(count)  # the event loop blocked in epoll_wait: waiting, not working
        else:
            groups[group_of(frames)] += int(count)
    total = sum(groups.values())
    shares = {k: v / total for k, v in groups.most_common()}
    return {"samples": total, "idle": idle, "groups": shares}


# label: streamed, turns per conversation (1: first turns only), answer tokens
PROFILES = {"json": (False, 1, 16), "stream": (True, 1, 128), "hits": (False, 0, 16)}
CLIENTS = 16


def steps(_: Plan) -> int:
    return len(PROFILES)


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    """Each load on the overhead section's engines and router, 16 clients at a time."""
    out: dict[str, Any] = {}
    with overhead.stack("profile") as st:
        for rnd, (label, (stream, turns, tokens)) in enumerate(PROFILES.items()):
            tick(f"profile {label}")
            spec = overhead.job(plan, st.url, stream=stream, clients=CLIENTS, rnd=rnd, turns=turns)
            # More conversations than fit: the deadline ends the job.
            spec.update(n=int(plan.profile_s * 2000), output_tokens=(tokens, tokens))
            out[label] = spied(plan, st, lg, spec)
    return out


def spied(plan: Plan, st: Stack, lg: LoadGen, spec: dict[str, Any]) -> dict[str, Any]:
    """The job run for plan.profile_s with py-spy on the stack's router: the parsed profile,
    the turns answered (hits among them) and the router's CPU per turn."""
    spec["deadline_s"] = plan.profile_s + 1.5
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.txt"
        argv = [str(py_spy()), "record", "-p", str(st.routers[0].proc.pid), "-o", str(path)]
        argv += ["--duration", str(int(plan.profile_s)), "--rate", "200", "--format", "raw"]
        spy = subprocess.Popen(
            [*argv, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        try:
            time.sleep(0.5)
            r, cpu = timed(st, lg, spec, st.router.proc.pid)
            spy.wait(timeout=30)
        finally:
            if spy.poll() is None:
                spy.kill()
                spy.wait(5)
        out = parse(path.read_text() if path.exists() else "")
    ok = [t for t in r["turns"] if t["ok"]]
    out["turns"], out["hits"] = len(ok), sum(1 for t in ok if t["reuse"] == "hit")
    out["cpu_ms_per_turn"] = cpu / max(1, len(r["turns"])) * 1000.0
    return out


TITLES = {"json": "first turns, JSON", "stream": "first turns, stream", "hits": "hits"}


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    """Section 5: per load, the share of the router's busy samples by group, its CPU."""
    labels = list(res)
    found = (g for x in labels for g in res[x]["groups"])  # a label of an older run too
    groups = dict.fromkeys([*(g for g, _ in GROUPS), IDLE_GROUP, *found])
    rows = [
        [g, *(f"{res[x]['groups'].get(g, 0.0) * 100:.0f}%" for x in labels)]
        for g in groups
        if any(res[x]["groups"].get(g) for x in labels)
    ]
    rows.append(["router CPU ms/turn", *(fmt(res[x]["cpu_ms_per_turn"], 3) for x in labels)])
    rows.append(["busy samples", *(str(res[x]["samples"]) for x in labels)])
    tops = [
        f"{TITLES.get(x, x)}: {top} ({share * 100:.0f}%)"
        for x in labels
        for top, share in list(res[x]["groups"].items())[:1]
    ]
    return [
        Screen(
            title="Profile",
            question="Where does the router's CPU go? py-spy (200 Hz) on the router while "
            "clients keep it busy; each busy sample is charged to the innermost frame of a "
            "known package, idle samples in epoll_wait left out.",
            tables=[Table(["share of busy samples", *(TITLES.get(x, x) for x in labels)], rows)],
            answer=["The largest share, per load: " + "; ".join(tops) + "."],
        )
    ]
