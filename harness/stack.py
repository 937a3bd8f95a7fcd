"""A whole stack as real processes: a private redis-server (or a given one, or none), P and D
simulators, a from-scratch reference simulator, and routers in front of them.

Everything binds 127.0.0.1 on free ports and is stopped by the ExitStack that started it
(also on Ctrl-C). Processes of one kind start in parallel; a start that timed out (other
engines load this machine) is tried once more.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from harness.procs import SimProc, redis_server, restart_redis, sim, sims, stop
from harness.router import RouterProc, router

T = TypeVar("T")


def argv_of(proc: subprocess.Popen[bytes]) -> list[str]:
    """The command line a process was started with."""
    args = proc.args
    return [str(a) for a in args] if isinstance(args, Sequence) else [str(args)]


@dataclass
class Stack:
    """Running processes. `ps`/`ds` are the P and D simulators; `p`, `d` and `router` the
    first of each; `commands` each process's command line, by label (P0, D0, router0...)."""

    ps: list[SimProc]
    ds: list[SimProc]
    routers: list[RouterProc]
    redis_url: str | None
    reference: SimProc | None = None
    redis_port: int | None = None
    redis_proc: subprocess.Popen[bytes] | None = None
    flags: dict[str, tuple[str, ...]] = field(default_factory=dict)  # by role, for restart
    commands: dict[str, list[str]] = field(default_factory=dict)
    exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    name: str = "stack"
    sim_timeout: float = 45.0

    @property
    def p(self) -> SimProc:
        return self.ps[0]

    @property
    def d(self) -> SimProc:
        return self.ds[0]

    @property
    def ref(self) -> SimProc:
        assert self.reference is not None, "this stack has no reference instance"
        return self.reference

    @property
    def router(self) -> RouterProc:
        return self.routers[0]

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def log(self) -> Path:
        return self.router.log

    @property
    def router_urls(self) -> list[str]:
        return [r.url for r in self.routers]

    @property
    def engines(self) -> list[SimProc]:
        return [*self.ps, *self.ds]

    def restart(
        self, role: str, index: int, *extra: str, down: Callable[[], None] = lambda: None
    ) -> SimProc:
        """Stop a P or D and start a new one on the same HTTP and side-channel ports (`down`
        runs in between), with the flags it was started with and `extra`."""
        group = self.ps if role == "prefill" else self.ds
        old = group[index]
        stop(old.proc)
        down()
        flags = self.flags.get(role, ())
        ports = ("--port", str(old.port), "--kv-port", str(old.kv_port))
        name = f"{self.name}-{role}"
        new = retried(
            lambda: sim(role, *flags, *ports, *extra, name=name, ready_timeout=self.sim_timeout),
            self.exits,
        )
        group[index] = new
        return new

    def stop_redis(self) -> None:
        if self.redis_proc is not None:
            stop(self.redis_proc)

    def start_redis(self) -> None:
        """Start the stack's redis-server again (empty, on its port) if it was stopped."""
        assert self.redis_port is not None, "this stack has no redis-server of its own"
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            return
        self.redis_proc = restart_redis(self.redis_port)


@contextlib.contextmanager
def start_stack(
    *,
    prefill: Sequence[Sequence[str]],
    decode: Sequence[Sequence[str]],
    reference: Sequence[str] | None = None,
    routers: Sequence[Sequence[str]] = ((),),
    redis: str | bool = True,
    name: str = "stack",
    sim_timeout: float = 45.0,
    router_timeout: float = 20.0,
    router_attempts: int = 1,
) -> Iterator[Stack]:
    """P and D simulators (one per flags list, all with the same role's flags: a P's flags
    are `prefill[i]`), a reference decode simulator (`reference` its flags; None: none),
    and one router per `routers` entry (its extra flags).

    redis: True for a private redis-server, a URL for a running one, False for the
    routers' in-memory store.
    """
    with contextlib.ExitStack() as exits:
        redis_url: str | None = None
        redis_port: int | None = None
        redis_proc: subprocess.Popen[bytes] | None = None
        commands: dict[str, list[str]] = {}
        if redis is True:
            redis_url, redis_port, redis_proc = exits.enter_context(redis_server())
            commands["redis"] = argv_of(redis_proc)
        elif isinstance(redis, str):
            redis_url = redis
        specs = [("prefill", *f) for f in prefill] + [("decode", *f) for f in decode]
        if reference is not None:
            specs.append(("decode", *reference))
        started = retried(lambda: sims(*specs, name=name, ready_timeout=sim_timeout), exits)
        ps, ds = started[: len(prefill)], started[len(prefill) : len(prefill) + len(decode)]
        ref = started[-1] if reference is not None else None
        for label, group in (("P", ps), ("D", ds)):
            for i, s in enumerate(group):
                commands[f"{label}{i}"] = argv_of(s.proc)
        urls = ([p.url for p in ps], [d.url for d in ds])
        up = enter_all(
            exits,
            [
                router(
                    *urls,
                    *args,
                    redis_url=redis_url,
                    name=f"{name}-router{i}" if len(routers) > 1 else f"{name}-router",
                    ready_timeout=router_timeout,
                    attempts=router_attempts,
                    stop_timeout=15,
                )
                for i, args in enumerate(routers)
            ],
        )
        for i, r in enumerate(up):
            commands[f"router{i}"] = argv_of(r.proc)
        flags = {"prefill": tuple(prefill[0]) if prefill else (), "decode": ()}
        flags["decode"] = tuple(decode[0]) if decode else ()
        st = Stack(
            ps,
            ds,
            up,
            redis_url,
            reference=ref,
            redis_port=redis_port,
            redis_proc=redis_proc,
            flags=flags,
            commands=commands,
            name=name,
            sim_timeout=sim_timeout,
        )
        with st.exits:
            try:
                yield st
            finally:
                st.stop_redis()  # the one running now (a test may have restarted it)


def enter_all(
    exits: contextlib.ExitStack, cms: Sequence[contextlib.AbstractContextManager[T]]
) -> list[T]:
    """Enter context managers in parallel (processes start together); each one that
    started is exited by `exits`, even when another failed or Ctrl-C came meanwhile."""
    if not cms:
        return []
    if len(cms) == 1:
        return [exits.enter_context(cms[0])]
    with concurrent.futures.ThreadPoolExecutor(len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
        try:
            concurrent.futures.wait(futures)
        finally:
            for cm, future in zip(cms, futures, strict=True):
                with contextlib.suppress(BaseException):
                    future.result()  # waits for a start still under way
                    exits.push(cm)
    return [f.result() for f in futures]


def retried(
    make: Callable[[], contextlib.AbstractContextManager[T]], exits: contextlib.ExitStack
) -> T:
    """Enter make() in exits; a start that timed out (other engines load this machine, and
    several processes start at once) is tried once more."""
    try:
        return exits.enter_context(make())
    except (TimeoutError, RuntimeError):
        return exits.enter_context(make())


@contextlib.contextmanager
def started(make: Callable[[], contextlib.AbstractContextManager[T]]) -> Iterator[T]:
    """retried() as a context manager of its own."""
    with contextlib.ExitStack() as exits:
        yield retried(make, exits)
