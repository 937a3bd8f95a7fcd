"""5. Where the router's CPU goes: py-spy samples of the router process under load.

py-spy (a pip package) attaches to the running router; idle samples (the event loop waiting)
are dropped, so the shares are of the router's busy time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import hitpath, overhead, workload
from bench.plan import Plan
from bench.stack import LoadGen, reset_caches, router_cpu, start_stack
from harness.stack import Stack

Tick = Callable[[str], None]

# Each sample is charged to the innermost frame of a known group (stdlib frames such as
# asyncio's socket writes are charged to their caller); the shares add up to 100%.
GROUPS = (
    (
        "SSE relay and capture (router/turn/sse.py, strip.py)",
        ("router/turn/sse.py", "router/turn/strip.py"),
    ),
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


def _in(path: str, prefix: str) -> bool:
    return path.startswith(prefix) or f"/{prefix}" in path


def group_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        path = frame_path(frame)
        if path in ENTRY:
            continue
        for group, prefixes in GROUPS:
            if any(_in(path, prefix) for prefix in prefixes):
                return group
    return IDLE_GROUP


def py_spy() -> str | None:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def available() -> bool:
    return py_spy() is not None


def record(pid: int, seconds: float, path: Path) -> subprocess.Popen[bytes]:
    exe = py_spy()
    assert exe is not None
    argv = [exe, "record", "-p", str(pid), "--duration", str(int(seconds))]
    argv += ["--rate", "200", "--format", "raw", "--nonblocking", "-o", str(path)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def parse(text: str) -> dict[str, Any]:
    """Self (leaf) shares of functions, exclusive group shares, inclusive router functions."""
    leaf: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    groups: Counter[str] = Counter()
    total = idle = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames[-1].startswith(IDLE_LEAF):
            idle += n  # the event loop blocked in epoll_wait: waiting, not working
            continue
        total += n
        leaf[_short(frames[-1])] += n
        groups[group_of(frames)] += n
        mine = (
            f
            for f in frames
            if frame_path(f) not in ENTRY
            and (_in(frame_path(f), "router/") or _in(frame_path(f), "sessions/"))
        )
        for name in {_short(f) for f in mine}:
            incl[name] += n
    if not total:
        return {"samples": 0, "idle": idle, "self": {}, "groups": {}, "inclusive_router": {}}
    return {
        "samples": total,
        "idle": idle,
        "self": {k: v / total for k, v in leaf.most_common(25)},
        "groups": {k: v / total for k, v in groups.most_common()},
        "inclusive_router": {k: v / total for k, v in incl.most_common(30)},
    }


def _short(frame: str) -> str:
    """'func (path/to/pkg/mod.py:12)' -> 'func (pkg/mod.py)'."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


PROFILES = (
    # label, paced D, streaming, max_tokens, clients
    ("json", False, False, 16, 16),
    ("stream", False, True, 128, 16),
    ("stream-paced", True, True, 128, 32),
)


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for paced in (False, True):
        with start_stack(
            prefill_args=[overhead.P_ARGS],
            decode_args=[[*overhead.D_ARGS, *(overhead.PACED if paced else [])]],
            router_args=[[]],
            name="profile",
        ) as st:
            for label, p, stream, tokens, clients in PROFILES:
                if p == paced:
                    tick(f"profile {label}")
                    out[label] = profile_load(plan, st, lg, stream, tokens, clients)
                    out[label]["paced"] = paced
    tick("profile hits")
    out["hits"] = profile_hits(plan, lg)
    return out


def spied(
    plan: Plan, st: Stack, lg: LoadGen, spec: dict[str, Any]
) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """Run the load generator's job with py-spy on the stack's router for plan.profile_s:
    (the job's result, the router's CPU seconds meanwhile, the parsed profile)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.txt"
        cpu0 = router_cpu(st)
        spy = record(st.routers[0].proc.pid, plan.profile_s, path)
        try:
            time.sleep(0.5)
            r = lg.run(spec, timeout=plan.profile_s + 60.0)
            spy.wait(timeout=30)
        finally:
            if spy.poll() is None:
                spy.kill()
                spy.wait(5)
        cpu = router_cpu(st) - cpu0
        text = path.read_text() if path.exists() else ""
    return r, cpu, parse(text)


def profile_hits(plan: Plan, lg: LoadGen, clients: int = 16) -> dict[str, Any]:
    """py-spy on the router while `clients` conversations at a time run JSON turns on the
    hit path's stack: every turn after a conversation's first claims, tokenizes, verifies
    and commits."""
    with hitpath.hit_stack("profile-hits") as st:
        spec = hitpath.job(plan, st.routers[0].url, stream=False, clients=clients, rnd=9, ids=True)
        spec.update(n=int(plan.profile_s * 2000), deadline_s=plan.profile_s + 1.5)
        r, cpu, result = spied(plan, st, lg, spec)
    turns = r["turns"]
    ok = [t for t in turns if t["ok"]]
    result.update(
        turns=len(ok),
        hits=sum(1 for t in ok if t["reuse"] == "hit"),
        max_tokens=workload.NONSTREAM_TOKENS,
        clients=clients,
        seconds=plan.profile_s,
        cpu_ms_per_turn=cpu / max(1, len(turns)) * 1000.0,
        events=0,
    )
    return result


def profile_load(
    plan: Plan, st: Stack, lg: LoadGen, stream: bool, tokens: int, clients: int
) -> dict[str, Any]:
    """py-spy on the router while `clients` clients keep it busy for plan.profile_s seconds."""
    spec = overhead.closed_job(
        overhead.via_router(st),
        stream=stream,
        concurrency=clients,
        count=int(plan.profile_s * 5000),  # more than fits: the deadline ends the job
        warmup=0,
        seed=3,
    )
    spec.update(max_tokens=tokens, deadline_s=plan.profile_s + 1.5)
    reset_caches(st)
    r, cpu, result = spied(plan, st, lg, spec)
    events = sum(r["events"])
    result.update(
        turns=r["ok"],
        max_tokens=tokens,
        clients=clients,
        seconds=plan.profile_s,
        cpu_ms_per_turn=cpu / max(1, r["sent"]) * 1000.0,
        events=events,
    )
    return result
