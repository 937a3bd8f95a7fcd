"""vLLM 0.33's pause and sleep (`POST /pause`, `/resume`, `/sleep`, `/wake_up`), one per API
server (every data-parallel rank): what a new request meets while the engine is not serving.

From the 0.33.0 wheel: `pause_generation` in modes "abort" and "wait" makes the engine core
refuse new requests with a retryable RequestError (code `engine_paused`), which the OpenAI
layer answers as HTTP 503 `ServiceUnavailableError`; mode "keep" and sleep leave that policy
alone: new requests are accepted and wait until /resume or /wake_up ("Level 0: Pause
scheduling only. Requests are still accepted but not processed"). Real vLLM serves these
routes only with VLLM_SERVER_DEV_MODE=1; the simulator always does on 0.33.
"""

from __future__ import annotations

import asyncio

from vllm_sim.errors import error_body

PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
# What a non-streaming request gets (RetryableRequestError through create_error_response:
# vLLM's ErrorInfo.code is the HTTP status; `engine_paused` is the engine-side code).
PAUSED_ERROR = error_body(PAUSED_MESSAGE, "ServiceUnavailableError", 503)
# What a stream gets as its one event (the stream generator catches GenerationError and
# answers it as InternalServerError with the exception's status).
PAUSED_STREAM_ERROR = error_body(PAUSED_MESSAGE, "InternalServerError", 503)


class EnginePaused(Exception):
    """A new request refused while paused (HTTP 503, retryable)."""


class Pause:
    def __init__(self) -> None:
        self.paused = False
        self.rejecting = False  # paused in mode abort or wait
        self.sleeping = False
        self.sleep_level = 0
        self._open = asyncio.Event()
        self._open.set()

    @property
    def open(self) -> bool:
        return not (self.paused or self.sleeping)

    def pause(self, mode: str) -> None:
        self.paused = True
        self.rejecting = mode != "keep"
        self._open.clear()

    def resume(self) -> None:
        self.paused = self.rejecting = False
        if not self.sleeping:
            self._open.set()

    def sleep(self, level: int) -> None:
        self.sleeping = True
        self.sleep_level = level
        self._open.clear()

    def wake_up(self) -> None:
        self.sleeping = False
        self.sleep_level = 0
        if not self.paused:
            self._open.set()

    async def admit(self) -> None:
        """Refuse the request (EnginePaused) or wait until the engine serves again."""
        while not self.open:
            if self.rejecting:
                raise EnginePaused(PAUSED_MESSAGE)
            await self._open.wait()
