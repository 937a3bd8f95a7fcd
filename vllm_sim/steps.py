"""One engine's step loop: running decodes and new prefill tokens share each step's time, as
in vLLM's continuous batching on one GPU. A step lasts `--prefill-ms-per-token` for every
prompt token it computes, plus one forward's fixed cost: `--decode-ms-per-token` when it
carries any decode, else `--first-token-forward-ms` when it finishes a prompt (a request's
first token needs a forward, even one whose whole prompt was pulled: vLLM recomputes its
last token). A prefill on D slows every decode batched with it, and concurrent prefills
share the GPU instead of running side by side.

KV pulls are asynchronous reads outside the steps, priced as vLLM's scheduler prices them:
the request is parked (WAITING_FOR_REMOTE_KVS) from the step that schedules it and starts its
read, through the read's modelled time (`--transfer-ms-per-pull` plus
`--transfer-ms-per-block` each), until the step that reports the read done (the step in
progress, or an empty one of `--pull-step-ms` on an idle engine); its prefill joins the step
after that one.

A step computes at most `--max-num-batched-tokens` prompt tokens (vLLM's chunked prefill):
a long prompt, or many at once, take several steps, and a short request queued behind them
joins the next step instead of waiting for all of them.

With both per-token costs at zero (the default) nothing waits on the loop: a request never
yields to the event loop here, so the simulator is as fast as without a cost model.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class _Prefill:
    """A queued prompt: the tokens still to compute, and the future its request waits on."""

    left: int
    fut: asyncio.Future[None]
    forward_ms: float = 0.0  # the fixed cost of the forward that computes its first token


@dataclass
class StepLoop:
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    max_batched_tokens: int = 8192  # prompt tokens one step computes (chunked prefill)
    pull_step_ms: float = 0.0  # an empty step's time: one that only reports a finished pull
    steps: int = 0  # steps run so far
    _step: asyncio.Future[None] | None = None  # the step in progress (None: the loop is idle)
    _prefills: list[_Prefill] = field(default_factory=list)
    _decodes: list[asyncio.Future[None]] = field(default_factory=list)
    _reports: list[asyncio.Future[None]] = field(default_factory=list)  # pulls awaiting a step
    _task: asyncio.Task[None] | None = None

    def step_s(self, prefill_tokens: int, decodes: int, forward_ms: float = 0.0) -> float:
        """How long one step takes: its prefill tokens, and one forward's fixed cost: the
        decode step's when it carries decodes, a finishing prompt's forward (the largest)
        otherwise. A step is one forward on the GPU: a prompt that finishes beside the
        running decodes rides their forward, it does not add one."""
        fixed = max(forward_ms, self.decode_ms_per_token if decodes else 0.0)
        return (prefill_tokens * self.prefill_ms_per_token + fixed) / 1000.0

    async def prefill(self, tokens: int, forward_ms: float = 0.0) -> None:
        """Compute `tokens` prompt tokens in the next step (the first output token with them);
        `forward_ms`: that forward's fixed cost (`--first-token-forward-ms`)."""
        if (tokens <= 0 or self.prefill_ms_per_token <= 0) and forward_ms <= 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A D leg that pulled every prompt token computes none here (its last is recomputed
        # for free): its forward for token 1 still costs forward_ms.
        self._prefills.append(_Prefill(max(tokens, 0), fut, forward_ms))
        await self._wait(fut)

    async def parked(self, transfer_s: float) -> None:
        """A pulling request in vLLM's WAITING_FOR_REMOTE_KVS. The scheduler takes it at the
        next step (its read starts with that step), the read takes `transfer_s`, and only a
        later step's get_finished reports it done: the step in progress then, or an empty
        one of `pull_step_ms` on an idle engine (whose loop keeps stepping while a request
        waits for remote KV). On return the request's prefill is due in the step after the
        one that reports it: queued now, while that step runs, it joins the next."""
        if self._step is not None and not self._step.done():
            await asyncio.shield(self._step)  # scheduled at the end of the step in progress
        await self.reported(transfer_s)

    async def reported(self, transfer_s: float) -> None:
        """The read's (remaining) time, then the step that reports it done (`parked`)."""
        if transfer_s > 0:
            await asyncio.sleep(transfer_s)
        if self._step is None and self.pull_step_ms > 0:  # idle: an empty step reports it
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._reports.append(fut)
            await self._wait(fut)

    async def decode(self) -> None:
        """One output token: the next step that carries this decode."""
        if self.decode_ms_per_token <= 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decodes.append(fut)
        await self._wait(fut)

    async def _wait(self, fut: asyncio.Future[None]) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        await fut

    async def _run(self) -> None:
        """Steps while work is queued: each takes the decodes queued when it began and up to
        max_batched_tokens prompt tokens, oldest first (a prompt may span steps)."""
        while self._prefills or self._decodes or self._reports:
            done, tokens, forward_ms = self._chunk()
            decodes, self._decodes = self._decodes, []
            reports, self._reports = self._reports, []
            live = sum(1 for fut in decodes if not fut.done())
            seconds = self.step_s(tokens, live, forward_ms)
            if reports and not (tokens or live or forward_ms):  # only reports finished pulls
                seconds = self.pull_step_ms / 1000.0
            self._step = asyncio.get_running_loop().create_future()
            try:
                await asyncio.sleep(seconds)
            finally:
                self._step.set_result(None)
                self._step = None
            self.steps += 1
            for fut in done + decodes + reports:
                if not fut.done():  # a cancelled request (client gone) is skipped
                    fut.set_result(None)

    def _chunk(self) -> tuple[list[asyncio.Future[None]], int, float]:
        """This step's prompt tokens: the futures of prompts it finishes, the tokens, and the
        fixed cost of its forward (the largest of the prompts it finishes)."""
        budget, done, kept = self.max_batched_tokens, [], []
        tokens, forward_ms = 0, 0.0
        for entry in self._prefills:
            if entry.fut.done():
                continue  # cancelled: its tokens are not computed
            take = min(entry.left, budget)
            budget -= take
            tokens += take
            entry.left -= take
            if entry.left:
                kept.append(entry)
            else:
                done.append(entry.fut)
                forward_ms = max(forward_ms, entry.forward_ms)
        self._prefills = kept
        return done, tokens, forward_ms
