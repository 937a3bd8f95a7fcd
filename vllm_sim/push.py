"""NixlPushConnector (push/WRITE mode) in the simulator: D registers the blocks it lacks with P
over P's side channel, P writes its KV into them after its prefill, D waits for the write.
Which params make a push leg, and P's returned params: vllm_sim/push_params.py.

The model (vLLM's `disagg_proxy_pushconnector_demo.py` and the push connector's registration,
reference sections 3.4 and 4.8):

- P's leg carries `do_remote_decode` and a `transfer_id`. After its prefill, P waits up to
  `kv_lease_duration` seconds for a registration with that transfer id, writes the blocks, and
  only then finishes. Without a registration in time it frees the blocks (its lease ended).
- D's leg carries `do_remote_prefill`, P's coordinates (`remote_engine_id`, `remote_host`,
  `remote_port`, `tp_size`, `pp_size`), `remote_request_id` (the router's request id, which P's
  own request must carry as X-Request-Id) and the `transfer_id`, no block ids. D registers the
  blocks it lacks, then waits up to `push_registration_timeout` seconds for P's write.
- A transfer id is single use: P refuses a registration for a transfer it already served (or
  gave up on), and a second registration of one in flight.

So a router that sends wrong coordinates or reuses a transfer id gets an error, and one that
calls P before D (sequentially) waits for P's lease and then gets an error: never a silent
success.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from vllm_sim.kvchannel import TransferError, pack, unpack
from vllm_sim.metrics import PushCounters
from vllm_sim.transfer import Leg

logger = logging.getLogger(__name__)

# Transfer ids P remembers as used (served or given up on); the oldest are forgotten first.
DONE_MEMORY = 4096


class Registration(msgspec.Struct, frozen=True):
    """What D sends P (the push connector's registration notification)."""

    transfer_id: str
    engine_id: str  # the P engine id D was told (remote_engine_id)
    request_id: str  # remote_request_id: the router's id for this turn
    decode_engine_id: str
    decode_host: str
    decode_port: int
    block_size: int
    start: int  # the first token position D lacks (block-aligned)
    count: int  # tokens D lacks
    block_ids: list[int]  # D's blocks for positions [start, start + count)
    tp_size: int = 1
    pp_size: int = 1


@dataclass
class _Slot:
    """P's side of one transfer id: the registration, once it came."""

    registration: Registration | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    created: float = field(default_factory=time.monotonic)


@dataclass
class _Wait:
    """D's side of one transfer id: where the written KV goes, and whether it came."""

    start: int
    count: int
    block_ids: list[int]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    blocks: list[list[int]] | None = None
    error: str = ""


class PushSide:
    """One engine's push state, both roles (an instance may be P for one request, D for
    another). The engine calls `produce` and `consume`; the side channel calls the routes."""

    def __init__(
        self,
        engine_id: str,
        block_size: int,
        read_kv: Callable[[Sequence[int]], list[list[int]]],
        lease_s: float,
        registration_timeout: float,
        tp_size: int = 1,
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self._read_kv = read_kv
        self._lease_s = lease_s
        self._registration_timeout = registration_timeout
        self.tp_size = tp_size
        self.any_engine = ""  # an engine id accepted besides this one (vllm_sim/moriio.py)
        self.counters = PushCounters()
        self._slots: dict[str, _Slot] = {}
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._waits: dict[str, _Wait] = {}

    def sweep(self) -> int:
        """Forget registrations no P request took within the lease (their P leg never came,
        or failed before its prefill); the transfer ids count as used."""
        now = time.monotonic()
        stale = [
            tid
            for tid, slot in self._slots.items()
            if slot.registration is not None and now - slot.created > self._lease_s
        ]
        for tid in stale:
            self._finish_transfer(tid)
        return len(stale)

    # -- P ----------------------------------------------------------------------------------

    def _finish_transfer(self, transfer_id: str) -> None:
        self._slots.pop(transfer_id, None)
        self._done[transfer_id] = None
        while len(self._done) > DONE_MEMORY:
            self._done.popitem(last=False)

    def register(self, reg: Registration) -> str:
        """A registration from D: "" if taken, else why it is refused."""
        if reg.engine_id != self.engine_id and not (self.any_engine == reg.engine_id != ""):
            why = f"engine id mismatch: registered for {reg.engine_id}, this is {self.engine_id}"
        elif reg.block_size != self.block_size:
            why = f"block size mismatch: {reg.block_size} vs {self.block_size}"
        elif reg.tp_size != self.tp_size:
            why = f"tp size mismatch: D was told {reg.tp_size}, P runs {self.tp_size}"
        elif reg.transfer_id in self._done:
            why = f"transfer_id {reg.transfer_id} was already used"
        else:
            slot = self._slots.setdefault(reg.transfer_id, _Slot())
            if slot.registration is None:
                slot.registration = reg
                slot.arrived.set()
                return ""
            why = f"transfer_id {reg.transfer_id} is already registered"
        self.counters.registrations_refused += 1
        logger.warning("push registration refused: %s", why)
        return why

    async def produce(
        self, leg: Leg, base_id: str, num_kv: int, block_ids: list[int], channel: Any
    ) -> None:
        """After P's prefill: wait for D's registration, then write the blocks D lacks."""
        assert leg.push is not None
        transfer_id = leg.push.transfer_id
        if transfer_id in self._done:
            logger.warning("request reuses transfer_id %s: nothing is written", transfer_id)
            return
        slot = self._slots.setdefault(transfer_id, _Slot())
        try:
            await asyncio.wait_for(slot.arrived.wait(), self._lease_s)
        except TimeoutError:
            self.counters.lease_expired += 1
            logger.warning("no registration for transfer %s within the lease", transfer_id)
            self._finish_transfer(transfer_id)
            return
        reg = slot.registration
        self._finish_transfer(transfer_id)
        assert reg is not None
        error = ""
        if base_id and reg.request_id != base_id:
            error = f"remote_request_id {reg.request_id} is not this transfer's request {base_id}"
        blocks: list[list[int]] = []
        if not error:
            blocks = self._blocks_for(reg, num_kv, block_ids)
        await self._write(channel, reg, blocks, error)

    def _blocks_for(self, reg: Registration, num_kv: int, block_ids: list[int]) -> list[list[int]]:
        """P's KV for D's positions [start, start + count); blocks P does not have are zeros
        (a D whose prompt is not P's gets wrong KV, as a real WRITE would give it)."""
        bs = self.block_size
        first = reg.start // bs
        wanted = len(reg.block_ids)
        have = max(0, min(wanted, -(-num_kv // bs) - first))
        out = self._read_kv(block_ids[first : first + have]) if have else []
        return out + [[0] * bs for _ in range(wanted - have)]

    async def _write(
        self, channel: Any, reg: Registration, blocks: list[list[int]], error: str
    ) -> None:
        body = {
            "engine_id": reg.decode_engine_id,
            "transfer_id": reg.transfer_id,
            "block_ids": reg.block_ids,
            "blocks": blocks,
            "error": error,
        }
        url = f"http://{reg.decode_host}:{reg.decode_port}/push/write"
        try:
            await channel.post(url, body)
        except TransferError as exc:
            logger.warning("push write to %s failed: %s", url, exc)
            return
        if not error:
            self.counters.writes += 1
            self.counters.blocks_written += len(blocks)
            self.counters.bytes_written += len(blocks) * self.block_size * 8

    # -- D ----------------------------------------------------------------------------------

    async def consume(
        self,
        leg: Leg,
        start: int,
        count: int,
        block_ids: list[int],
        me: tuple[str, int],
        channel: Any,
    ) -> list[list[int]]:
        """Register D's blocks for positions [start, start+count) with P, wait for the write."""
        peer = leg.push
        assert peer is not None
        bs = self.block_size
        local = block_ids[start // bs : (start + count - 1) // bs + 1]
        wait = _Wait(start, count, local)
        if peer.transfer_id in self._waits:
            raise TransferError(f"transfer_id {peer.transfer_id} is already being received")
        self._waits[peer.transfer_id] = wait
        reg = Registration(
            transfer_id=peer.transfer_id,
            engine_id=peer.engine_id,
            request_id=peer.request_id,
            decode_engine_id=self.engine_id,
            decode_host=me[0],
            decode_port=me[1],
            block_size=bs,
            start=start,
            count=count,
            block_ids=local,
            tp_size=peer.tp_size,
            pp_size=peer.pp_size,
        )
        try:
            self.counters.registrations_sent += 1
            await channel.post(
                f"http://{peer.host}:{peer.port}/push/register", msgspec.to_builtins(reg)
            )
            try:
                await asyncio.wait_for(wait.done.wait(), self._registration_timeout)
            except TimeoutError:
                self.counters.timeouts += 1
                raise TransferError(
                    f"no KV written for transfer {peer.transfer_id} within "
                    f"push_registration_timeout ({self._registration_timeout} s)"
                ) from None
        finally:
            self._waits.pop(peer.transfer_id, None)
        if wait.error:
            raise TransferError(f"P refused the transfer: {wait.error}")
        assert wait.blocks is not None
        self.counters.blocks_received += len(wait.blocks)
        return wait.blocks

    def written(self, body: dict[str, Any]) -> str:
        """P's write for one of D's registrations: "" if taken, else why it is refused."""
        if body.get("engine_id") != self.engine_id:
            return "engine id mismatch"
        wait = self._waits.get(str(body.get("transfer_id")))
        if wait is None:
            return "no registration waits for this transfer_id"
        error, blocks = body.get("error"), body.get("blocks")
        if isinstance(error, str) and error:
            wait.error = error
        elif (
            body.get("block_ids") != wait.block_ids
            or not isinstance(blocks, list)
            or len(blocks) != len(wait.block_ids)
        ):
            wait.error = "the write does not match the registered blocks"
        else:
            wait.blocks = blocks
        wait.done.set()
        return ""


def add_routes(app: web.Application, side: PushSide) -> None:
    """The push endpoints of the side channel: /push/register (on P), /push/write (on D)."""

    async def register(request: web.Request) -> web.Response:
        body = await unpack(request)
        try:
            reg = msgspec.convert(body, Registration)
        except msgspec.ValidationError as exc:
            return pack({"error": f"bad registration: {exc}"}, status=400)
        why = side.register(reg)
        return pack({"error": why}, status=409) if why else pack({"registered": True})

    async def write(request: web.Request) -> web.Response:
        why = side.written(await unpack(request))
        return pack({"error": why}, status=409) if why else pack({"written": True})

    app.router.add_post("/push/register", register)
    app.router.add_post("/push/write", write)
