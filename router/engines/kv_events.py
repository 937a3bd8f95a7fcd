"""One engine's KV-events subscriber: ZMQ SUB on its topic, sequence tracking, replay on a
gap (DEALER to the replay ROUTER), restarts and reconnects, feeding its `EngineIndex`.

Wire (vLLM 0.32): multipart (topic, 8-byte big-endian seq [+ 16-byte publisher id on newer
vLLM], msgpack [ts, [events], dp_rank]); events are maps tagged "type" (vllm#42892) or, on
older vLLM, positional arrays with the tag first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.engines.kv_index import EngineIndex

log = logging.getLogger("kvbaton.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Out of sync (a replay that did not answer, a rebuild): the replay is asked again this often.
REPLAY_RETRY_S = 10.0
# Turns run on an engine whose stream has delivered nothing before the router warns.
SILENT_AFTER_TURNS = 5

# Field order of the positional (pre-#42892) events after the tag; later fields may be absent.
# The simulator's decoder has the same table (vllm_sim/events_decode.py): written twice because
# the simulator shares no code with the router, so a change to one must be made in the other.
_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> dict[str, Any] | None:
    if isinstance(raw, dict):
        return raw if isinstance(raw.get("type"), str) else None
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return {"type": raw[0], **dict(zip(_FIELDS.get(raw[0], ()), raw[1:], strict=False))}
    return None


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    """(ts, events) of one batch, given as an array or a map; bad events are skipped.
    Raises ValueError for a payload that is no batch at all."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError(f"not a KV event batch: {raw!r:.80}")
    ts = float(raw[0]) if isinstance(raw[0], int | float) else 0.0
    return ts, [e for e in map(_event, raw[1]) if e is not None]


@dataclass(frozen=True)
class Source:
    """Where one engine publishes: its base URL, the SUB endpoint, the replay endpoint."""

    url: str
    endpoint: str
    replay: str = ""
    topic: str = ""


@dataclass
class Counts:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0  # batches applied from a replay
    rebuilds: int = 0  # the index cleared because events were lost for good or it restarted
    bad: int = 0
    last_seq: int = -1
    lag: float = 0.0  # router receive time - the batch's ts (engine clock) of the last batch


class Subscriber:
    """Keeps `index` in step with one engine. `run()` until cancelled."""

    def __init__(
        self,
        source: Source,
        index: EngineIndex,
        ctx: zmq.asyncio.Context,
        *,
        clock: Callable[[], float] = time.time,
        replay_timeout: float = 2.0,
    ) -> None:
        self.source = source
        self.index = index
        self.counts = Counts()
        self._ctx = ctx
        self._clock = clock
        self._replay_timeout = replay_timeout
        self._expected: int | None = None  # the next seq to apply
        self._publisher = b""
        self._last_payload = b""  # the last batch applied, to recognise its publisher again
        self._live_last: int | None = None  # the last seq the SUB socket delivered
        # The index follows the engine's whole stream: a replay answered (what the engine
        # still buffers is its own account), or the engine's first batch seen live. Until
        # then, and after a rebuild, the index claims nothing (index.stale).
        self._synced = False
        self._retry_at = 0.0
        self.turns = 0  # turns that ran on this engine (note_turn)
        self.warning = ""  # why the index may not follow the engine (for /status, the log)

    async def run(self) -> None:
        while True:
            try:
                await self._connected()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV events of %s: subscriber failed; reconnecting", self.source.url)
                self.index.stale = True
                await asyncio.sleep(1.0)

    async def _connected(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_monitor(await monitor.recv_multipart())
                if sub in ready:
                    await self._on_message(await sub.recv_multipart())
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            # The engine may be restarting: claim nothing until its stream is known again.
            log.info("KV events of %s: disconnected", self.source.url)
            self.index.stale = True
        elif event == zmq.EVENT_CONNECTED:
            log.info("KV events of %s: connected", self.source.url)
            if self._expected is None:
                await self._catch_up(0)
            else:
                await self._resume(self._expected - 1)

    async def _resume(self, last: int) -> None:
        """Back after a disconnect: the same publisher still buffers our last batch as we
        applied it; anything else is a restarted engine (or a buffer past our place)."""
        if not self.source.replay:
            return  # stale until the live stream tells (a restart: its seq starts over)
        batches = await self._replay(last)
        if batches is None:
            return
        if batches and batches[0] == (last, self._last_payload):
            self._apply_all(batches[1:])
            self.index.stale = not self._synced
            return
        self._rebuild("the engine restarted, or its replay buffer no longer holds our place")
        self._expected, self._live_last = None, None
        await self._catch_up(0)

    async def _catch_up(self, start: int) -> None:
        """Apply what the replay buffer holds from `start` (nothing without a replay socket);
        an answer puts the index in sync, none leaves it out until a later try answers."""
        self._retry_at = self._clock() + REPLAY_RETRY_S
        batches = await self._replay(start) if self.source.replay else []
        if batches is None:
            self.index.stale = True
            return
        self._apply_all(batches)
        self._synced = True
        self.index.stale = False
        if self.warning.startswith("no replay"):
            self.warning = ""

    def _apply_all(self, batches: list[tuple[int, bytes]]) -> None:
        for seq, payload in batches:
            if self._expected is not None and seq < self._expected:
                continue
            if self._expected is not None and seq > self._expected:
                self._rebuild("the replay buffer no longer holds the lost batches")
            self._apply(seq, payload)
            self.counts.replays += 1

    async def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or len(frames[1]) < 8:
            self.counts.bad += 1
            return
        seq, publisher = int.from_bytes(frames[1][:8], "big"), frames[1][8:]
        # One publisher's live seqs only grow: one at or below the last live one (or a new
        # publisher id, newer vLLM) is a restarted engine, whose seq starts at 0 again.
        restarted = (publisher != self._publisher and bool(self._publisher)) or (
            self._live_last is not None and seq <= self._live_last
        )
        self._publisher, self._live_last = publisher, seq
        if restarted:
            self._rebuild("the engine restarted (its sequence started over)")
            self._expected = None
            if seq > 0:
                await self._catch_up(0)
        if self._expected is None and seq == 0:
            self._synced = True  # the engine's first batch: nothing came before it
        elif not self._synced and self.source.replay and self._clock() >= self._retry_at:
            await self._catch_up(0)
        if self._expected is not None and seq > self._expected:
            self.counts.gaps += 1
            log.warning(
                "KV events of %s: gap, expected seq %d, got %d; replaying",
                self.source.url,
                self._expected,
                seq,
            )
            await self._catch_up(self._expected)
            if self._expected is not None and seq > self._expected:
                self._rebuild(f"batches {self._expected}..{seq - 1} were lost")
        if self._expected is not None and seq < self._expected:
            return  # already applied from a replay
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            ts, events = decode_batch(payload)
        except ValueError as exc:
            self.counts.bad += 1
            log.warning("KV events of %s: batch %d skipped: %s", self.source.url, seq, exc)
        else:
            now = self._clock()
            self.index.apply(events, now)
            self.counts.batches += 1
            self.counts.events += len(events)
            self.counts.lag = max(0.0, now - ts) if ts else 0.0
        self._expected, self._last_payload = seq + 1, payload
        self.counts.last_seq = seq
        self.index.stale = not self._synced
        if self.warning.startswith("no batch"):
            log.info("KV events of %s: the engine publishes again", self.source.url)
            self.warning = ""

    def _rebuild(self, why: str) -> None:
        log.warning("KV events of %s: index rebuilt: %s", self.source.url, why)
        self.counts.rebuilds += 1
        self.index.clear(self._clock())
        self._synced = False  # until a replay answers again

    def note_turn(self) -> None:
        """A turn ran on this engine: one that publishes must have sent something by now."""
        self.turns += 1
        if self.counts.batches or self.warning or self.turns < SILENT_AFTER_TURNS:
            return
        self.warning = (
            f"no batch received from {self.source.endpoint} while {self.turns} turns ran on "
            "this engine: the likely cause is an endpoint without a wildcard in the engine's "
            "--kv-events-config (tcp://HOST:PORT makes vLLM connect instead of bind; use "
            "tcp://*:PORT), else a wrong port, a firewall, or enable_kv_cache_events off"
        )
        log.warning("KV events of %s: %s", self.source.url, self.warning)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from `start` (DEALER, as a REQ envelope: vLLM answers one
        message per batch, which REQ would not read), or None when the replay fails."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.source.replay)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(self._replay_timeout * 1000):
                    self.warning = (
                        f"no replay answered at {self.source.replay} within "
                        f"{self._replay_timeout:g} s: the index claims nothing until one does "
                        "(set the engine's replay_endpoint, e.g. tcp://*:PORT+1)"
                    )
                    log.warning("KV events of %s: %s", self.source.url, self.warning)
                    return None
                frames = await dealer.recv_multipart()
                seq_bytes, payload = frames[-2], frames[-1]
                if seq_bytes[:8] == END_OF_REPLAY:
                    return out
                out.append((int.from_bytes(seq_bytes[:8], "big"), payload))
        finally:
            dealer.close(linger=0)
