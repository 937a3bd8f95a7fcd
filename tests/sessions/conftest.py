"""Fixtures for the session store tests: a hand-driven clock and one sample handle."""

from __future__ import annotations

from typing import Any

import pytest


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def params() -> dict[str, Any]:
    """A D handle as vLLM returns it (bidirectional NixlConnector)."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": "d-engine-1",
        "remote_block_ids": [[3, 4, 5]],
        "remote_request_id": "chatcmpl-abc-123",
        "remote_host": "10.0.0.2",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 40,
    }
