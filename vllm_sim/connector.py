"""The engine's KV connector: the leg a request's kv_transfer_params make, loading its KV
(a NIXL pull, a push write, the shared store), and request_finished (pin and describe)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_sim import model, moriio, push, push_params, transfer
from vllm_sim.blocks import BlockPool
from vllm_sim.config import SimSettings
from vllm_sim.errors import KVLoadError
from vllm_sim.kvchannel import KVChannelClient, TransferError
from vllm_sim.kvstore import KVStore
from vllm_sim.metrics import Counters
from vllm_sim.pins import Pin, PinTable
from vllm_sim.request import GenRequest, RunResult, Seq

logger = logging.getLogger(__name__)


class Connector:
    def __init__(
        self,
        settings: SimSettings,
        pool: BlockPool,
        pins: PinTable,
        counters: Counters,
        channel: KVChannelClient,
        now: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.engine_id = settings.engine_id
        self.block_size = settings.block_size
        self.pool = pool
        self.pins = pins
        self.counters = counters
        self.channel = channel
        self.now = now
        self._abandoned: set[asyncio.Task[None]] = set()  # notifications of aborted requests
        # vLLM 0.33's remote_registration_generation: 1 after the first registration, one
        # more after each re-registration (a wake-up after a sleep).
        self.generation = 1
        self.store: KVStore | None = None
        if settings.kv_connector == "store":
            self.store = KVStore(settings.kv_store, settings.model, self.block_size, counters)
        self.push = (
            push.PushSide(
                self.engine_id,
                self.block_size,
                pool.read,
                settings.kv_lease_duration,
                settings.push_registration_timeout,
            )
            if settings.kv_connector == "nixl-push" or settings.moriio_mode == "WRITE"
            else None
        )
        if self.push is not None and settings.kv_connector == "moriio":
            self.push.any_engine = moriio.ANY_ENGINE  # MoRI-IO's D is never told P's id

    def classify(self, req: GenRequest) -> transfer.Leg:
        # The store connector reads no kv_transfer_params (MooncakeStoreConnector).
        params = req.kv_params if self.store is None else None
        if self.settings.kv_connector == "moriio":  # addresses from the id (vllm_sim/moriio.py)
            try:
                params = moriio.as_rules(params, req.base_id, self.settings.moriio_mode)
            except KVLoadError:
                self.counters.nixl_failed_transfers += 1
                self.counters.sim_requests_failed += 1
                raise
        pushed = push_params.classify(params) if self.push is not None else None
        return pushed or transfer.classify(params, self.settings.bidirectional)

    def abandon(self, req: GenRequest) -> None:
        """A request aborted before its KV load began: when it was to pull P's blocks, notify
        P so that it frees them now (vLLM's request_finished sends an empty receive for a
        request whose do_remote_prefill is still set), not after its kv_lease_duration."""
        try:
            leg = self.classify(req)
        except KVLoadError:
            return
        if leg.kind != "pull_prompt" or leg.source is None:
            return
        self._notify_later(leg.source)

    def _notify_later(self, src: transfer.RemoteSource) -> None:
        """Tell the producer to free its blocks, beside the request: vLLM's notification goes
        out with the worker's next transfers and holds up no request."""
        notify = self.channel.notify(
            src.host, src.port, src.engine_id, src.request_id, src.generation
        )
        task = asyncio.get_running_loop().create_task(notify)
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        task.add_done_callback(self._notified)

    def _notified(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logger.warning("KV free notification failed: %s", task.exception())
        self.counters.nixl_failed_notifications += 1

    # -- loading a request's KV -----------------------------------------------------------

    async def pull_or_notify(
        self,
        src: transfer.RemoteSource,
        seq: Seq,
        start: int,
        count: int,
        parked: Callable[[int], Awaitable[None]],
    ) -> int:
        """Pull count tokens into positions [start, start+count); 0 on recompute fallback.

        The request waits out `parked(blocks)`, the modelled read and the step that reports
        it (vLLM's WAITING_FOR_REMOTE_KVS); the side channel's exchange, which fetches the
        blocks' contents, runs beside that wait: its wire time is the simulator's, not the
        model's, and adds only where it outlasts the modelled time."""
        if count == 0:
            # Nothing to read: only tell the producer to free its blocks (vLLM sends the
            # notification through an empty read, which the request does not wait for).
            self._notify_later(src)
            return 0
        read = asyncio.ensure_future(self._read(src, seq, start, count))
        try:
            await parked(-(-count // self.block_size))
            return await read
        finally:
            if not read.done():
                read.cancel()  # the request was cancelled while parked
            elif not read.cancelled():
                read.exception()  # retrieved: a cancelled request's failed read is not logged

    async def _read(self, src: transfer.RemoteSource, seq: Seq, start: int, count: int) -> int:
        ch = self.channel
        started = time.monotonic()
        try:
            if src.expiry is not None:
                # Only a forwarded deadline needs the producer's clock (vllm#47021), as
                # measured at the first handshake: no round trip per read.
                hs = await ch.clock(src.host, src.port, src.engine_id, src.generation)
                if transfer.is_expired(src.expiry, hs.remote_now(self.now())):
                    self.counters.sim_reads_declined += 1
                    raise TransferError(f"Declining expired remote read for {src.request_id}")
            try:
                remote = transfer.remote_blocks(src.block_ids, start, count, self.block_size)
            except ValueError as exc:
                raise TransferError(str(exc)) from exc
            blocks = await ch.read(
                src.host,
                src.port,
                src.engine_id,
                self.block_size,
                remote,
                src.request_id,
                src.generation,
            )
        except TransferError as exc:
            return self._load_failed(exc, "KV load")
        self.counters.sim_read_wait.observe(time.monotonic() - started)
        return self._loaded(seq, start, count, blocks)

    async def receive_push(
        self, leg: transfer.Leg, seq: Seq, start: int, count: int, me: tuple[str, int]
    ) -> int:
        """Push mode's D: register the blocks it lacks with P and wait for P's write."""
        try:
            if self.push is None or leg.push is None:
                raise TransferError("push params without P's coordinates")
            blocks = await self.push.consume(leg, start, count, seq.block_ids, me, self.channel)
        except TransferError as exc:
            return self._load_failed(exc, "push KV load")
        return self._loaded(seq, start, count, blocks)

    def _load_failed(self, exc: TransferError, what: str) -> int:
        """A failed KV load: the request fails (policy fail) or recomputes (0 tokens loaded)."""
        self.counters.nixl_failed_transfers += 1
        if self.settings.kv_load_failure_policy == "fail":
            self.counters.sim_requests_failed += 1
            logger.warning("%s failed (policy fail): %s", what, exc)
            raise KVLoadError(str(exc)) from exc
        logger.warning("%s failed, recomputing: %s", what, exc)
        return 0

    def _loaded(self, seq: Seq, start: int, count: int, blocks: list[list[int]]) -> int:
        self._copy_pulled(seq, start, count, blocks)
        self.counters.nixl_transfers += 1
        self.counters.nixl_bytes_transferred += len(blocks) * self.block_size * 8
        return count

    def _copy_pulled(self, seq: Seq, start: int, count: int, blocks: list[list[int]]) -> None:
        bs = self.block_size
        first = start // bs
        kv: list[int] = []
        for pos in range(start, start + count):
            content = blocks[pos // bs - first]
            off = pos % bs
            kv.append(int(content[off]) if off < len(content) else 0)
        self.pool.write(seq.block_ids, start, kv)

    async def store_load(self, req: GenRequest, seq: Seq) -> int:
        """Load the prompt's blocks after the local hit from the store, by hash; the tokens
        loaded (the last prompt token is always computed, as vLLM does)."""
        assert self.store is not None
        bs = self.block_size
        start = len(seq.hashes)
        wanted = model.block_hashes(req.prompt, bs)[start : (len(req.prompt) - 1) // bs]
        found = await self.store.load(wanted)
        for i, kv in enumerate(found):
            self.pool.write(seq.block_ids, (start + i) * bs, kv)
        seq.loaded = range(start, start + len(found))
        return len(found) * bs

    async def store_save(self, seq: Seq, num_kv: int) -> None:
        """Write the full blocks of the first num_kv tokens this request has not written
        and did not load from the store."""
        if self.store is None:
            return
        full = num_kv // self.block_size
        todo = [b for b in range(seq.saved, full) if b not in seq.loaded]
        seq.saved = max(seq.saved, full)
        blocks = self.pool.read([seq.block_ids[b] for b in todo])
        await self.store.save([seq.hashes[b] for b in todo], blocks)

    # -- the finish -----------------------------------------------------------------------

    def finished(
        self, req: GenRequest, seq: Seq, leg: transfer.Leg, res: RunResult, port: int
    ) -> dict[str, Any] | None:
        """vLLM's request_finished: pin and describe the blocks, or return None."""
        if leg.kind == "none":
            return None
        if not leg.is_producer and not self.settings.bidirectional:
            return None  # a D node without bidirectional_kv_xfer returns no params
        if leg.kind == "push_producer":
            # Written already (or the lease ended): push mode pins nothing after the finish.
            return push_params.producer_params(
                self.engine_id, self.settings.side_channel_host, port, len(req.prompt)
            )
        num_kv = len(seq.tokens) - 1  # the last sampled token has no KV yet
        keep = -(-num_kv // self.block_size)
        pinned, spare = seq.block_ids[:keep], seq.block_ids[keep:]
        seq.block_ids = []
        self.pool.free(spare)
        ttl = (
            self.settings.kv_lease_duration
            if leg.is_producer
            else self.settings.decoder_kv_blocks_ttl
        )
        expiry = self.now() + ttl
        kind = "lease" if leg.is_producer else "decoder"
        pin_id = req.request_id
        if self.settings.kv_connector == "moriio":  # D frees them by the transfer id
            pin_id = moriio.pin_id(req.kv_params, req.request_id)
        self.pins.pin(Pin(pin_id, pinned, expiry, kind))
        self.counters.sim_blocks_pinned += len(pinned)
        params = transfer.finished_params(
            is_producer=leg.is_producer,
            block_ids=pinned,
            engine_id=self.engine_id,
            request_id=req.request_id,
            host=self.settings.side_channel_host,
            port=port,
            num_tokens=num_kv,
            expiry=None if leg.is_producer else expiry,
            cached_tokens=res.cached_tokens,
        )
        if leg.is_producer and self.settings.seed_first_token:
            params["first_token_ids"] = res.output_ids[:1]  # vllm#51919: token 1 for D
        if self.push is not None:
            params["transfer_mode"] = "push"
        elif self.settings.version.registration_generation:
            params["remote_registration_generation"] = self.generation
        return params
