"""The request lifecycle: admission, prefix hits, KV pulls, prefill, decode, pins and params.

One asyncio loop owns all state; the side channel reads it through the KVSource methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_sim import model, moriio, push, transfer
from vllm_sim.blocks import BlockPool, CacheEvent
from vllm_sim.config import SimSettings
from vllm_sim.costs import CostModel, spend
from vllm_sim.errors import KVLoadError
from vllm_sim.kvchannel import KVChannelClient, TransferError
from vllm_sim.kvstore import KVStore
from vllm_sim.metrics import Counters, Gauges
from vllm_sim.output import OutputText
from vllm_sim.pins import Pin, PinTable
from vllm_sim.steps import StepLoop
from vllm_sim.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class GenRequest:
    request_id: str  # internal id, with vLLM's random suffix (#27987)
    prompt: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    kv_params: dict[str, Any] | None = None
    base_id: str = ""  # the X-Request-Id it came with (push mode pairs P and D by it)
    dp_rank: int | None = None  # X-data-parallel-rank (None: any rank; vllm_sim/dp.py)


@dataclass(frozen=True)
class Step:
    token_ids: list[int]
    content: str
    reasoning: str
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class RunResult:
    """Filled in by the engine while a request runs; read by the HTTP layer."""

    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Seq:
    tokens: list[int]
    block_ids: list[int]
    hashes: list[int]  # hashes of the full blocks whose KV is complete, in order
    hit_tokens: int = 0
    last_kv: int = model.KV_ROOT
    loaded: range = range(0)  # the blocks loaded from the shared store (store connector)
    saved: int = 0  # blocks [0, saved) are written to the store or were loaded from it


class Engine:
    def __init__(
        self,
        settings: SimSettings,
        kv_port: int,
        clock: Callable[[], float] = time.monotonic,
        on_events: Callable[[list[CacheEvent]], None] | None = None,
        channel: KVChannelClient | None = None,
    ) -> None:
        self.settings = settings
        self.engine_id = settings.engine_id
        self.agent = uuid.uuid4().hex  # this process's NIXL agent name
        self.block_size = settings.block_size
        self.kv_port = kv_port
        self.tok = Tokenizer()
        self.pool = BlockPool(settings.num_blocks, settings.block_size)
        self.pins = PinTable(self.pool)
        self.counters = Counters()
        self.costs = CostModel(
            settings.prefill_ms_per_token,
            settings.transfer_ms_per_block,
            settings.decode_ms_per_token,
        )
        self.steps = StepLoop(settings.prefill_ms_per_token, settings.decode_ms_per_token)
        self.channel = channel or KVChannelClient(settings.handshake_timeout)
        self.store: KVStore | None = None
        if settings.kv_connector == "store":
            self.store = KVStore(settings.kv_store, settings.model, self.block_size, self.counters)
        self._clock = clock
        self._on_events = on_events
        self.push = (
            push.PushSide(
                self.engine_id,
                self.block_size,
                self.pool.read,
                settings.kv_lease_duration,
                settings.push_registration_timeout,
            )
            if settings.kv_connector == "nixl-push" or settings.moriio_mode == "WRITE"
            else None
        )
        if self.push is not None and settings.kv_connector == "moriio":
            self.push.any_engine = moriio.ANY_ENGINE  # MoRI-IO's D is never told P's id
        self._slots = asyncio.Semaphore(settings.max_num_seqs)
        self._freed = asyncio.Event()
        self.running = 0
        self.waiting = 0

    # -- KVSource (the side channel serves these) ----------------------------------------

    def now(self) -> float:
        return self._clock()

    def read_blocks(self, block_ids: Sequence[int]) -> list[list[int]] | None:
        if any(not 0 < b < self.pool.num_blocks for b in block_ids):
            self.counters.sim_reads_refused += 1
            return None
        self.counters.sim_reads_served += 1
        return self.pool.read(block_ids)

    def release(self, request_id: str) -> bool:
        pin = self.pins.release(request_id)
        if pin is None:
            # vLLM logs "Potentially invalid KV blocks for unrecognized request".
            self.counters.sim_notify_unknown += 1
            return False
        self.counters.sim_blocks_freed += len(pin.block_ids)
        self._freed.set()
        return True

    # -- housekeeping ---------------------------------------------------------------------

    def sweep(self) -> int:
        """Free expired pins; the number of requests whose pins expired."""
        if self.push is not None:
            self.push.sweep()
        expired = self.pins.sweep(self.now())
        for pin in expired:
            logger.info("Releasing expired KV blocks for request %s", pin.request_id)
            self.counters.nixl_kv_expired_reqs += 1
            self.counters.sim_blocks_expired += len(pin.block_ids)
        if expired:
            self._freed.set()
        return len(expired)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self._publish()

    def gauges(self) -> Gauges:
        return Gauges(
            kv_cache_usage=self.pool.usage,
            running=self.running,
            waiting=self.waiting,
            pinned_requests=len(self.pins),
            pinned_blocks=self.pins.num_blocks,
        )

    def _publish(self) -> None:
        events = self.pool.drain_events()
        if events and self._on_events is not None:
            self._on_events(events)

    # -- the request ----------------------------------------------------------------------

    async def generate(self, req: GenRequest, result: RunResult) -> AsyncGenerator[Step, None]:
        """Run one request; yields one Step per generated token. Close it with aclosing()."""
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        seq: _Seq | None = None
        try:
            seq = await self._admit(req)
            leg = self._classify(req)
            await self._prefill(req, seq, leg, result)
            if leg.kind == "push_producer" and self.push is not None:
                await self.push.produce(
                    leg, req.base_id, len(req.prompt), seq.block_ids, self.channel
                )
            async for step in self._decode(req, seq, leg, result):
                yield step
        finally:
            if seq is not None and seq.block_ids:
                self.pool.free(seq.block_ids)
                self._freed.set()
            self._publish()
            self.running -= 1
            self._slots.release()

    def _classify(self, req: GenRequest) -> transfer.Leg:
        # The store connector reads no kv_transfer_params (MooncakeStoreConnector).
        params = req.kv_params if self.store is None else None
        if self.settings.kv_connector == "moriio":  # addresses from the id (vllm_sim/moriio.py)
            try:
                params = moriio.as_rules(params, req.base_id, self.settings.moriio_mode)
            except KVLoadError:
                self.counters.nixl_failed_transfers += 1
                self.counters.sim_requests_failed += 1
                raise
        pushed = push.classify(params) if self.push is not None else None
        return pushed or transfer.classify(params, self.settings.bidirectional)

    async def _admit(self, req: GenRequest) -> _Seq:
        """Wait until the blocks for prompt + max_tokens fit, then take hits and allocate."""
        bs = self.block_size
        positions = len(req.prompt) + max(req.max_tokens, 1) - 1
        total = -(-positions // bs)
        hashes = model.block_hashes(req.prompt, bs)
        max_hit = (len(req.prompt) - 1) // bs  # at least the last prompt token is computed
        while True:
            hit = self.pool.match_prefix(hashes[:max_hit])
            if self.pool.free_needed(hit, total - len(hit)) <= self.pool.num_free:
                break
            if self.sweep() == 0:
                self._freed.clear()
                await self._freed.wait()
        self.pool.touch(hit)
        ids = hit + self.pool.allocate(total - len(hit))
        seq = _Seq(list(req.prompt), ids, hashes[: len(hit)], hit_tokens=len(hit) * bs)
        if hit:
            seq.last_kv = self.pool.kv_at(ids, seq.hit_tokens - 1)
        return seq

    async def _prefill(self, req: GenRequest, seq: _Seq, leg: transfer.Leg, res: RunResult) -> None:
        c = self.counters
        n = len(req.prompt)
        hit = seq.hit_tokens
        s = self.settings
        count = transfer.tokens_to_pull(
            leg, n, hit, s.kv_recompute_threshold, s.threshold_gates_prefill_pulls
        )
        if leg.source is not None or self.store is not None:
            c.external_prefix_cache_queries += n - hit
        pulled = 0
        if leg.source is not None:
            pulled = await self._pull_or_notify(leg.source, seq, hit, count)
        elif leg.kind in ("push_consumer", "push_broken"):
            c.external_prefix_cache_queries += n - hit
            pulled = await self._receive_push(leg, seq, hit, n - hit)
        elif self.store is not None:
            pulled = await self._store_load(req, seq)
        c.external_prefix_cache_hits += pulled
        # Compute the rest; with everything pulled, recompute the last prompt token (as vLLM).
        start = min(hit + pulled, n - 1)
        prev = self.pool.kv_at(seq.block_ids, start - 1) if start > 0 else model.KV_ROOT
        kv = model.kv_chain(prev, req.prompt[start:])
        self.pool.write(seq.block_ids, start, kv)
        seq.last_kv = kv[-1]
        self._cache_blocks(seq, n)
        if self.settings.role == "prefill":  # kv_producer: the prompt's blocks
            await self._store_save(seq, n)
        computed = n - hit - pulled
        c.prompt_tokens += n
        c.prefix_cache_queries += n
        c.prefix_cache_hits += hit
        c.by_source["local_cache_hit"] += hit
        c.by_source["external_kv_transfer"] += pulled
        c.by_source["local_compute"] += computed
        res.cached_tokens = hit + pulled
        if leg.kind == "pull_prompt" and leg.source is not None:
            # vLLM 0.32 reports P's count on D (output_processor copies it).
            res.cached_tokens = leg.source.cached_tokens or 0
        c.prompt_tokens_cached += res.cached_tokens
        self._publish()
        pulled_blocks = -(-pulled // self.block_size) if pulled else 0
        await spend(self.costs.transfer_s(pulled_blocks))  # NIXL reads: outside the steps
        await self.steps.prefill(computed)  # shares its step with the running decodes

    async def _pull_or_notify(
        self, src: transfer.RemoteSource, seq: _Seq, start: int, count: int
    ) -> int:
        """Pull count tokens into positions [start, start+count); 0 on recompute fallback."""
        ch = self.channel
        if count == 0:
            # Nothing to read: only tell the producer to free its blocks (vLLM sends the
            # notification through an empty read).
            try:
                await ch.notify(src.host, src.port, src.engine_id, src.request_id)
            except TransferError as exc:
                logger.warning("KV free notification failed: %s", exc)
                self.counters.nixl_failed_notifications += 1
            return 0
        try:
            if src.expiry is not None:
                # Only a forwarded deadline needs the producer's clock (vllm#47021).
                hs = await ch.handshake(src.host, src.port, src.engine_id)
                if transfer.is_expired(src.expiry, hs.remote_now(self.now())):
                    self.counters.sim_reads_declined += 1
                    raise TransferError(f"Declining expired remote read for {src.request_id}")
            try:
                remote = transfer.remote_blocks(src.block_ids, start, count, self.block_size)
            except ValueError as exc:
                raise TransferError(str(exc)) from exc
            blocks = await ch.read(
                src.host, src.port, src.engine_id, self.block_size, remote, src.request_id
            )
        except TransferError as exc:
            return self._load_failed(exc, "KV load")
        return self._loaded(seq, start, count, blocks)

    async def _receive_push(self, leg: transfer.Leg, seq: _Seq, start: int, count: int) -> int:
        """Push mode's D: register the blocks it lacks with P and wait for P's write."""
        try:
            if self.push is None or leg.push is None:
                raise TransferError("push params without P's coordinates")
            me = (self.settings.side_channel_host, self.kv_port)
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

    def _loaded(self, seq: _Seq, start: int, count: int, blocks: list[list[int]]) -> int:
        self._copy_pulled(seq, start, count, blocks)
        self.counters.nixl_transfers += 1
        self.counters.nixl_bytes_transferred += len(blocks) * self.block_size * 8
        return count

    def _copy_pulled(self, seq: _Seq, start: int, count: int, blocks: list[list[int]]) -> None:
        bs = self.block_size
        first = start // bs
        kv: list[int] = []
        for pos in range(start, start + count):
            content = blocks[pos // bs - first]
            off = pos % bs
            kv.append(int(content[off]) if off < len(content) else 0)
        self.pool.write(seq.block_ids, start, kv)

    async def _store_load(self, req: GenRequest, seq: _Seq) -> int:
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

    async def _store_save(self, seq: _Seq, num_kv: int) -> None:
        """Write the full blocks of the first num_kv tokens this request has not written
        and did not load from the store."""
        if self.store is None:
            return
        full = num_kv // self.block_size
        todo = [b for b in range(seq.saved, full) if b not in seq.loaded]
        seq.saved = max(seq.saved, full)
        blocks = self.pool.read([seq.block_ids[b] for b in todo])
        await self.store.save([seq.hashes[b] for b in todo], blocks)

    def _cache_blocks(self, seq: _Seq, num_kv: int) -> None:
        """Cache every full block whose KV is complete (under this instance's token ids)."""
        bs = self.block_size
        done = len(seq.hashes)
        full = num_kv // bs
        if full <= done:
            return
        parent = seq.hashes[-1] if seq.hashes else None
        new_hashes: list[int] = []
        prev = parent
        for b in range(done, full):
            prev = model.block_hash(prev, seq.tokens[b * bs : (b + 1) * bs])
            new_hashes.append(prev)
        self.pool.cache_full_blocks(
            seq.block_ids[done:full], new_hashes, parent, seq.tokens[done * bs : full * bs]
        )
        seq.hashes.extend(new_hashes)

    async def _decode(
        self, req: GenRequest, seq: _Seq, leg: transfer.Leg, res: RunResult
    ) -> AsyncIterator[Step]:
        text = OutputText(
            self.tok,
            req.stop,
            req.include_stop_str_in_output,
            req.min_tokens,
            self.settings.reasoning_tokens,
        )
        emittable = self.tok.emittable
        for i in range(req.max_tokens):
            if i:
                await self.steps.decode()
            token = model.sample(seq.last_kv, emittable)
            seq.tokens.append(token)
            res.output_ids.append(token)
            self.counters.generation_tokens += 1
            delta = text.add(token)
            finish = None
            if delta.stop_reason is not None:
                finish = "stop"
            elif i + 1 == req.max_tokens:
                finish = "length"
            content = delta.content + (text.flush() if finish == "length" else "")
            if finish is None:
                pos = len(seq.tokens) - 1
                seq.last_kv = model.kv_next(seq.last_kv, token)
                self.pool.write(seq.block_ids, pos, [seq.last_kv])
                self._cache_blocks(seq, pos + 1)
            else:
                if self.settings.kv_store_save_decode:
                    await self._store_save(seq, len(seq.tokens) - 1)
                res.content, res.reasoning = text.content, text.reasoning
                res.finish_reason, res.stop_reason = finish, delta.stop_reason
                res.kv_transfer_params = self._finish(req, seq, leg, res)
                if self.settings.kv_connector == "moriio":
                    transfer_id = (req.kv_params or {}).get("transfer_id")
                    res.kv_transfer_params = moriio.finished(res.kv_transfer_params, transfer_id)
                self.counters.request_success[finish] = (
                    self.counters.request_success.get(finish, 0) + 1
                )
            yield Step([token], content, delta.reasoning, finish, delta.stop_reason)
            if finish is not None:
                return

    def _finish(
        self, req: GenRequest, seq: _Seq, leg: transfer.Leg, res: RunResult
    ) -> dict[str, Any] | None:
        """vLLM's request_finished: pin and describe the blocks, or return None."""
        self._publish()
        if leg.kind == "none":
            return None
        if not leg.is_producer and not self.settings.bidirectional:
            return None  # a D node without bidirectional_kv_xfer returns no params
        if leg.kind == "push_producer":
            # Written already (or the lease ended): push mode pins nothing after the finish.
            return push.producer_params(
                self.engine_id, self.settings.side_channel_host, self.kv_port, len(req.prompt)
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
            port=self.kv_port,
            num_tokens=num_kv,
            expiry=None if leg.is_producer else expiry,
            cached_tokens=res.cached_tokens,
        )
        if self.push is not None:
            params["transfer_mode"] = "push"
        return params
