"""The request lifecycle: admission, prefix hits, prefill (KV loads by the connector), decode.

One asyncio loop owns all state; the side channel reads it through the KVSource methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from vllm_sim import handover, model, moriio, transfer
from vllm_sim.blocks import BlockPool, CacheEvent
from vllm_sim.config import SimSettings
from vllm_sim.connector import Connector
from vllm_sim.costs import CostModel
from vllm_sim.kvchannel import KVChannelClient
from vllm_sim.metrics import Counters, Gauges
from vllm_sim.output import OutputText
from vllm_sim.pins import PinTable
from vllm_sim.request import GenRequest, RunResult, Seq, Step
from vllm_sim.steps import StepLoop
from vllm_sim.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
        self.connector_version = settings.version.connector_version
        self.registered = True  # False while asleep (the KV cache is discarded)
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
            settings.transfer_ms_per_pull,
        )
        self.steps = StepLoop(
            settings.prefill_ms_per_token,
            settings.decode_ms_per_token,
            settings.max_num_batched_tokens,
            settings.pull_step_ms,
        )
        self._clock = clock
        self._on_events = on_events
        version = self.connector_version
        channel = channel or KVChannelClient(settings.handshake_timeout, connector_version=version)
        self.kv = Connector(settings, self.pool, self.pins, self.counters, channel, self.now)
        self.channel, self.store, self.push = self.kv.channel, self.kv.store, self.kv.push
        self._slots = asyncio.Semaphore(settings.max_num_seqs)
        self._freed = asyncio.Event()
        self.running = 0
        self.waiting = 0
        self.idle = asyncio.Event()  # set when the last running request ends (a sleep waits)

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

    def sleep(self) -> None:
        """Sleep level 1+: the KV cache is discarded (its memory released; block contents are
        gone) and deregistered from NIXL. Pins stay listed, as vLLM's scheduler keeps them."""
        self.registered = False
        self.pool.wipe()
        self._publish()

    def wake_up(self) -> None:
        """The KV cache is allocated and registered again: a new NIXL registration, so the
        handshake payload changed and the registration generation rises (vLLM 0.33)."""
        self.registered = True
        self.agent = uuid.uuid4().hex
        self.kv.generation += 1

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
        """Run one request; yields one Step per generated token. Close it with aclosing().
        Aborted (its client left) before it began loading P's blocks, it tells P to free them,
        as vLLM's request_finished does for a request that still has do_remote_prefill."""
        began = [False]
        try:
            async with contextlib.aclosing(self._generate(req, result, began)) as steps:
                async for step in steps:
                    yield step
        except asyncio.CancelledError:
            if not began[0]:
                self.kv.abandon(req)
            raise

    async def _generate(
        self, req: GenRequest, result: RunResult, began: list[bool]
    ) -> AsyncGenerator[Step, None]:
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        seq: Seq | None = None
        try:
            seq = await self._admit(req)
            leg = self.kv.classify(req)
            began[0] = True
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
            if not self.running:
                self.idle.set()
            self._slots.release()

    async def _admit(self, req: GenRequest) -> Seq:
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
        seq = Seq(list(req.prompt), ids, hashes[: len(hit)], hit_tokens=len(hit) * bs)
        if hit:
            seq.last_kv = self.pool.kv_at(ids, seq.hit_tokens - 1)
        return seq

    async def _prefill(self, req: GenRequest, seq: Seq, leg: transfer.Leg, res: RunResult) -> None:
        c = self.counters
        n = len(req.prompt)
        hit = seq.hit_tokens
        s = self.settings
        count = transfer.tokens_to_pull(
            leg, n, hit, s.kv_recompute_threshold, s.threshold_gates_prefill_pulls
        )
        if leg.source is not None or self.store is not None:
            c.external_prefix_cache_queries += n - hit
        pulled, wire = 0, time.monotonic()
        if leg.source is not None:
            pulled = await self.kv.pull_or_notify(leg.source, seq, hit, count, self._parked)
        elif leg.kind in ("push_consumer", "push_broken"):
            c.external_prefix_cache_queries += n - hit
            me = (s.side_channel_host, self.kv_port)
            pulled = await self.kv.receive_push(leg, seq, hit, n - hit, me)
        elif self.store is not None:
            pulled = await self.kv.store_load(req, seq)
        if pulled and leg.source is None:  # a push or store load: its wait counts toward it
            wire = time.monotonic() - wire
            await self.steps.reported(self.costs.transfer_s(-(-pulled // self.block_size)) - wire)
        c.external_prefix_cache_hits += pulled
        # Compute the rest; with everything pulled, recompute the last prompt token (as vLLM).
        start = min(hit + pulled, n - 1)
        prev = self.pool.kv_at(seq.block_ids, start - 1) if start > 0 else model.KV_ROOT
        kv = model.kv_chain(prev, req.prompt[start:])
        self.pool.write(seq.block_ids, start, kv)
        seq.last_kv = kv[-1]
        self._cache_blocks(seq, n)
        if self.settings.role == "prefill":  # kv_producer: the prompt's blocks
            await self.kv.store_save(seq, n)
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
        failed = count > 0 and not pulled
        seq.seed = handover.seed_for(s, c, self.tok, req, leg.kind, failed)
        if seq.seed is None:  # shares its step with the running decodes; a seed skips it
            await self.steps.prefill(computed, s.first_token_forward_ms)

    async def _parked(self, blocks: int) -> None:  # a pull's read and its report (steps.py)
        await self.steps.parked(self.costs.transfer_s(blocks))

    def _cache_blocks(self, seq: Seq, num_kv: int) -> None:
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
        self, req: GenRequest, seq: Seq, leg: transfer.Leg, res: RunResult
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
            if not i and seq.seed is not None:  # vllm#51919: P's token 1, no forward
                token = handover.emit(self.counters, seq.seed, token)
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
                    await self.kv.store_save(seq, len(seq.tokens) - 1)
                res.content, res.reasoning = text.content, text.reasoning
                res.finish_reason, res.stop_reason = finish, delta.stop_reason
                self._publish()  # then vLLM's request_finished (the connector's)
                res.kv_transfer_params = self.kv.finished(req, seq, leg, res, self.kv_port)
                if self.settings.kv_connector == "moriio":
                    transfer_id = (req.kv_params or {}).get("transfer_id")
                    res.kv_transfer_params = moriio.finished(res.kv_transfer_params, transfer_id)
                self.counters.request_success[finish] = (
                    self.counters.request_success.get(finish, 0) + 1
                )
            yield Step([token], content, delta.reasoning, finish, delta.stop_reason)
            if finish is not None:
                return
