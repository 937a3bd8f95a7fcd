"""4. What the session store costs per turn: round trips (a short MONITOR sample, outside the
timed runs), server time (INFO commandstats deltas of the timed runs), loopback RTT."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import redis.asyncio as aioredis

from bench.stack import LoadGen
from bench.stats import pct
from harness.stack import Stack

_LINE = re.compile(r'^\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"')
SCRIPT_COMMANDS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


@contextlib.contextmanager
def monitor(redis_url: str, path: Path) -> Iterator[None]:
    """`redis-cli MONITOR` into a file while the block runs (only for untimed samples)."""
    exe = shutil.which("redis-cli")
    if exe is None:
        raise RuntimeError("redis-cli is not installed")
    port = str(urlparse(redis_url).port)
    with open(path, "wb") as fh:
        proc = subprocess.Popen(
            [exe, "-h", "127.0.0.1", "-p", port, "monitor"], stdout=fh, stderr=subprocess.STDOUT
        )
        try:
            time.sleep(0.3)
            yield
            time.sleep(0.3)
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def parse_monitor(text: str) -> tuple[Counter[str], Counter[str]]:
    """(commands sent by clients, commands run inside scripts), lower-case names."""
    top: Counter[str] = Counter()
    inner: Counter[str] = Counter()
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        source, cmd = m.group(1), m.group(2).lower()
        (inner if source == "lua" else top)[cmd] += 1
    return top, inner


def monitor_sample(st: Stack, lg: LoadGen, router_index: int) -> dict[str, Any]:
    """Round trips per turn: 4 conversations x 3 non-streaming turns through one router."""
    assert st.redis_url is not None
    spec = {
        "kind": "conversations",
        "target": {"mode": "router", "urls": [st.routers[router_index].url]},
        "n": 4,
        "turns": 3,
        "concurrency": 4,
        "stream": False,
        "system_words": (200, 200),
        "user_words": (20, 20),
        "output_tokens": (16, 16),
        "jitter_s": 0.0,
        "seed": 99,
        "deadline_s": 60.0,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "monitor.txt"
        with monitor(st.redis_url, path):
            r = lg.run(spec, timeout=90.0)
        top, inner = parse_monitor(path.read_text(errors="replace"))
    turns = sum(1 for t in r["turns"] if t["ok"])
    first = sum(1 for t in r["turns"] if t["ok"] and t["turn"] == 1)
    hits = sum(1 for t in r["turns"] if t["ok"] and t["reuse"].startswith("hit"))
    return {
        "turns": turns,
        "first_turns": first,
        "hits": hits,
        "top": dict(top),
        "inner": dict(inner),
        "round_trips_per_turn": sum(top.values()) / turns if turns else None,
    }


def per_turn(delta: dict[str, dict[str, float]], turns: int, top: set[str]) -> dict[str, Any]:
    """Calls and server microseconds per turn; `top` names the commands clients send."""
    if not turns:
        return {}
    calls = {cmd: v["calls"] / turns for cmd, v in delta.items()}
    client_usec = sum(v["usec"] for cmd, v in delta.items() if cmd in top)
    return {
        "calls_per_turn": calls,
        "round_trips_per_turn": sum(v["calls"] for c, v in delta.items() if c in top) / turns,
        "server_usec_per_turn": client_usec / turns,
    }


async def _rtt(url: str, n: int) -> dict[str, float]:
    client = aioredis.Redis.from_url(url)
    script = client.register_script("return redis.call('HGETALL', KEYS[1])")
    times: dict[str, list[float]] = {"ping": [], "script": []}
    try:
        await client.ping()
        await script(keys=["kvbaton:bench:missing"])
        for _ in range(n):
            t0 = time.perf_counter()
            await client.ping()
            t1 = time.perf_counter()
            await script(keys=["kvbaton:bench:missing"])
            t2 = time.perf_counter()
            times["ping"].append(t1 - t0)
            times["script"].append(t2 - t1)
    finally:
        await client.aclose()
    return {f"{k}_{q}_us": pct(v, q) * 1e6 for k, v in times.items() for q in (50, 99) if v}


def rtt(url: str, n: int = 500) -> dict[str, float]:
    """Loopback round trip of a redis-py asyncio client: PING and a one-command EVALSHA."""
    return asyncio.run(_rtt(url, n))


async def _history_cost(url: str, n: int, sizes: tuple[int, ...]) -> dict[str, float]:
    """The history lookup (one MGET of k candidate keys, one of them set) and the index write
    (SET PX), through the router's own store on a real redis-server."""
    from sessions.keys import history_key
    from sessions.redis_store import RedisSessionStore

    store = RedisSessionStore(url, timeout=1.0)
    out: dict[str, float] = {}
    try:
        keys = [history_key("bench", f"{i:032x}") for i in range(max(sizes))]
        await store.index_history(keys[0], "3 h-" + "0" * 32, 60.0)
        for k in sizes:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                await store.find_history(keys[:k][::-1])
                times.append(time.perf_counter() - t0)
            out[f"lookup_{k}_50_us"] = pct(times, 50) * 1e6
            out[f"lookup_{k}_99_us"] = pct(times, 99) * 1e6
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await store.index_history(keys[1], "5 h-" + "1" * 32, 60.0)
            times.append(time.perf_counter() - t0)
        out["index_50_us"], out["index_99_us"] = pct(times, 50) * 1e6, pct(times, 99) * 1e6
    finally:
        await store.close()
    return out


def history_cost(
    url: str, n: int = 500, sizes: tuple[int, ...] = (1, 4, 16, 64, 256)
) -> dict[str, float]:
    """Per-turn cost of history sessions: the lookup by candidate count, and the index write."""
    return asyncio.run(_history_cost(url, n, sizes))


async def _server_usec(client: aioredis.Redis, command: str) -> tuple[float, float]:
    """(calls, usec) of one command so far (INFO commandstats)."""
    stats = await client.info("commandstats")
    entry = stats.get(f"cmdstat_{command}", {})
    return float(entry.get("calls", 0)), float(entry.get("usec", 0))


async def _pin_note_cost(url: str, n: int, sizes: tuple[int, ...]) -> dict[str, float]:
    """The commit with its pin note (one COMMIT_NOTED) of a handle of k blocks on D: a first
    turn (k blocks new to the member) and the next turn of the same conversation on the same D
    (those k blocks and 16 more), as the client waits for it (p50) and as Redis spends on it
    (INFO commandstats: the script's microseconds per call, which block every other client)."""
    from sessions.keys import (
        conversation_key,
        pin_blocks_key,
        pin_held_key,
        pin_sizes_key,
        pins_key,
    )
    from sessions.model import PinSize, SessionState
    from sessions.redis_store import RedisSessionStore
    from sessions.store import PinNote

    store = RedisSessionStore(url, timeout=5.0)
    raw = aioredis.Redis.from_url(url)
    decode = "http://bench-pins:8200"
    out: dict[str, float] = {}
    try:
        for k in sizes:
            names = [f"0:{b}" for b in range(1, k + 17)]
            first, following = " ".join(names[:k]), " ".join(names)
            notes = (
                ("first", 0, PinNote(decode, 1.0, PinSize(k, 16 * k, first))),
                ("next", 1, PinNote(decode, 2.0, PinSize(k + 16, 16 * k + 256, following))),
            )
            keys = [conversation_key("bench", f"pins-{k}-{i}") for i in range(n)]
            for label, turn, note in notes:
                state = SessionState(turn=turn + 1, decode=decode)
                await store.commit(keys[0] + "-warm", state, turn, 60.0, note)  # loads the script
                times = []
                calls, usec = await _server_usec(raw, "evalsha")
                for key in keys:
                    t0 = time.perf_counter()
                    await store.commit(key, state, turn, 60.0, note)
                    times.append(time.perf_counter() - t0)
                calls2, usec2 = await _server_usec(raw, "evalsha")
                out[f"{label}_{k}_50_us"] = pct(times, 50) * 1e6
                out[f"{label}_{k}_server_us"] = (usec2 - usec) / max(calls2 - calls, 1)
            index = pins_key(decode)
            beside = (pin_sizes_key(decode), pin_held_key(decode), pin_blocks_key(decode))
            await raw.delete(*keys, keys[0] + "-warm", index, *beside)
    finally:
        await store.close()
        await raw.aclose()
    return out


def pin_note_cost(
    url: str, n: int = 100, sizes: tuple[int, ...] = (0, 16, 128, 1024, 8192)
) -> dict[str, float]:
    """What the pin note adds to the commit, by the handle's blocks (0: no blocks named)."""
    return asyncio.run(_pin_note_cost(url, n, sizes))


def top_level(sample: dict[str, Any]) -> set[str]:
    names = set(sample.get("top", {}))
    return names | set(SCRIPT_COMMANDS)


def main() -> None:
    """`python -m bench.redis_cost`: the history lookup's and the pin note's cost on a private
    redis-server."""
    import json

    from harness.procs import redis_server

    with redis_server() as (url, _, _):
        out = {"rtt": rtt(url), "history": history_cost(url), "pin_note": pin_note_cost(url)}
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
