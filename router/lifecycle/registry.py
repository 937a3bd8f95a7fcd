"""The instance registry: admin changes to the pool (add, drain, remove), stored by
sessions/registry_store.py (in Redis, so they survive a restart and reach every replica).
Command-line instances are the base; the registry's entries apply on top, and each replica
re-reads them every `health_interval`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from router.engines.dns import DnsExpander
from router.engines.kv_watch import parse_sources
from router.engines.pool import Instance, Role
from router.errors import ConfigError
from router.lifecycle.discovery import inspect
from router.services import Services
from sessions.registry_store import Entry, Registry, State
from sessions.store import StoreError

log = logging.getLogger("kvbaton.registry")


def desired(
    base: Mapping[Role, Iterable[str]], entries: Mapping[str, Entry]
) -> dict[tuple[Role, str], bool]:
    """(role, url) -> draining, for every instance the pool should hold (pure)."""
    want = {(role, url): False for role, urls in base.items() for url in urls}
    for url, entry in entries.items():
        if entry.state == "removed":
            want.pop((entry.role, url), None)
        else:
            want[(entry.role, url)] = entry.state == "draining"
    return want


async def admit(svc: Services, inst: Instance) -> str:
    """Check a new instance as vLLM's XpYd proxy does (its /v1/models): "" if it may join,
    else why not. Also learns its model and KV block size."""
    await inspect(svc, inst)
    if not inst.healthy:
        # discovery.inspect writes "check failed: <why>"; the reason says it once, not twice.
        error = inst.last_error.removeprefix("check failed: ")
        return f"{inst.url} did not answer /v1/models: {error}"
    if not inst.model:
        return f"{inst.url}/v1/models lists no model"
    if svc.model and inst.model != svc.model:
        return f"{inst.url} serves model {inst.model!r}, the router serves {svc.model!r}"
    if svc.block_size and inst.block_size and inst.block_size != svc.block_size:
        return (
            f"{inst.url} uses KV blocks of {inst.block_size} tokens, the router's instances "
            f"use {svc.block_size}"
        )
    return ""


def entry(
    role: Role, state: State, clock: Callable[[], float] = time.time, kv_events: str = ""
) -> Entry:
    return Entry(role=role, state=state, updated_at=round(clock(), 3), kv_events=kv_events)


def check_events_spec(url: str, spec: str) -> None:
    """Raises ConfigError unless `spec` is empty or `ENDPOINT[,REPLAY]` (as --kv-events)."""
    if spec:
        parse_sources([f"{url}={spec}"], 0, (), "")


def follow_events(svc: Services, url: str, spec: str) -> None:
    """Read the KV events of an engine that joined at run time: from `spec` (the admin add's
    `ENDPOINT[,REPLAY]`), else its `--kv-events` entry or `--kv-events-port` on its host."""
    settings = svc.settings
    specs = [*settings.kv_events, *([f"{url}={spec}"] if spec else [])]
    try:
        src = parse_sources(specs, settings.kv_events_port, [url], settings.kv_events_topic).get(
            url
        )
    except ConfigError as exc:  # a registry entry written by hand
        log.warning("not reading the KV events of %s: %s", url, exc)
        return
    if src is not None and svc.kv_events is not None and svc.kv_events.follow(src):
        svc.metrics.watch_kv_events(svc.kv_events)
        log.info("reading the KV events of %s from %s", url, src.endpoint)


async def forget_events(svc: Services, url: str) -> None:
    if svc.kv_events is not None:
        await svc.kv_events.forget(url)


@dataclass
class Syncer:
    """Keeps one replica's pool equal to the command line (each host name expanded to its
    addresses with `dns`) plus the registry."""

    svc: Services
    registry: Registry
    dns: DnsExpander | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _refused: dict[str, str] = field(default_factory=dict)
    _entries: dict[str, Entry] = field(default_factory=dict)

    def base(self) -> dict[Role, tuple[str, ...]]:
        settings, connector = self.svc.settings, self.svc.connector
        return {  # plus the instances that announced themselves (MoRI-IO's registration)
            "prefill": (*settings.prefill, *connector.announced("prefill")),
            "decode": (*settings.decode, *connector.announced("decode")),
        }

    async def _base_urls(self) -> dict[Role, tuple[str, ...]]:
        base = self.base()
        if self.dns is None:
            return base
        return {role: await self.dns.expand(urls) for role, urls in base.items()}

    async def sync(self) -> None:
        """Re-resolve the names, re-read the registry and apply both; raises StoreError when
        the registry cannot be read (with DNS on, after applying the names to the last
        registry read: an address change does not wait for Redis)."""
        base = await self._base_urls()
        error: StoreError | None = None
        # Read and apply under the lock the admin API holds while it changes an entry: a read
        # from before an admin add, applied after it, would take the new instance out again.
        async with self.lock:
            try:
                self._entries = await self.registry.load()
            except StoreError as exc:
                if self.dns is None:
                    raise
                error = exc
            await self._apply(desired(base, self._entries))
        if error is not None:
            raise error

    def _drain_vanished(self, inst: Instance) -> bool:
        """An address gone from DNS with turns still on it drains until they finish."""
        removed = (e := self._entries.get(inst.url)) is not None and e.state == "removed"
        if self.dns is None or not inst.outstanding or removed:
            return False
        if not inst.draining:
            inst.draining = True
            log.info("%s instance %s draining (its address left DNS)", inst.role, inst.url)
        return True

    async def _apply(self, want: dict[tuple[Role, str], bool]) -> None:
        pool = self.svc.pool
        for inst in pool.instances():
            key = (inst.role, inst.url)
            if key not in want:
                if self._drain_vanished(inst):
                    continue
                pool.remove(inst)
                await forget_events(self.svc, inst.url)
                log.info("removed %s instance %s (registry or DNS)", inst.role, inst.url)
            elif inst.draining != want[key]:
                inst.draining = want[key]
                log.info(
                    "%s instance %s %s (registry)",
                    inst.role,
                    inst.url,
                    "draining" if inst.draining else "active again",
                )
        joining = [
            Instance(url, role, draining=draining)
            for (role, url), draining in want.items()
            if pool.find(role, url) is None
        ]
        await asyncio.gather(*(self._join(inst) for inst in joining))

    async def _join(self, inst: Instance) -> None:
        """An instance another replica added (or this one before a restart)."""
        reason = await admit(self.svc, inst)
        if reason and inst.healthy:
            # It answers but does not fit (model, block size): keep it out, say so once.
            if self._refused.get(inst.url) != reason:
                self._refused[inst.url] = reason
                log.warning("not adding %s instance from the registry: %s", inst.role, reason)
            return
        # Unreachable ones join unhealthy; the health loop re-admits them when they answer.
        self._refused.pop(inst.url, None)
        self.svc.pool.add(inst)
        known = self._entries.get(inst.url)
        follow_events(self.svc, inst.url, known.kv_events if known is not None else "")
        log.info(
            "added %s instance %s (registry)%s",
            inst.role,
            inst.url,
            f", unhealthy for now: {inst.last_error}" if reason else "",
        )

    async def resync(self) -> None:
        """Sync now (an announced MoRI-IO instance came or went); a failing store waits."""
        try:
            await self.sync()
        except StoreError as exc:
            log.warning("instance registry unavailable, resync deferred: %s", exc)

    async def loop(self, interval: float) -> None:
        """Every `interval` seconds; a failing store is reported once, then retried quietly."""
        failing = False
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sync()
            except StoreError as exc:
                if not failing:
                    log.warning("instance registry unavailable, keeping the pool as is: %s", exc)
                failing = True
            else:
                failing = False


async def start(syncer: Syncer, interval: float) -> asyncio.Task[None]:
    """Merge the registry into the pool once (best effort), then keep re-reading it."""
    try:
        await syncer.sync()
    except StoreError as exc:
        log.warning("instance registry unavailable at start, using the command line: %s", exc)
    return asyncio.create_task(syncer.loop(interval))


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
