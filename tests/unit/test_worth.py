"""Whether a pull pays (issue 49): what P lacks, judged from the state alone, and what a P
is learned to read (pure)."""

from __future__ import annotations

import pytest

from router.engines.reads import VLLM_RECOMPUTE_THRESHOLD, Reads
from router.turn import worth
from sessions.model import SessionState

P = "http://p0:8000"


def state(tokens: int, prefill_tokens: int, prefill: str = P) -> SessionState:
    return SessionState(
        prefill=prefill, prefill_tokens=prefill_tokens, token_count=tokens, block_size=16
    )


@pytest.mark.parametrize(
    ("st", "prefill", "kept", "expected"),
    [
        (state(90, 45), P, 1.0, 58),  # P holds its last prompt's 2 full blocks
        (state(90, 45), "http://p1:8000", 1.0, 90),  # another P holds nothing
        (state(90, 45), P, 0.5, 74),  # P kept half of what it held
        (state(90, 45), P, 0.0, 90),  # P evicts everything
        (state(90, 0), P, 1.0, 90),  # not known: the whole handle
        (state(30, 45), P, 1.0, 0),  # P holds more than D (an edited answer)
    ],
)
def test_lacking(st: SessionState, prefill: str, kept: float, expected: int) -> None:
    assert worth.lacking(st, prefill, kept) == expected


def test_a_p_reads_everything_until_it_skips_twice() -> None:
    reads = Reads()
    assert worth.pays(1, reads.floor)
    reads.skipped(40)  # one: a failed read looks the same
    assert reads.floor == 0
    reads.skipped(300)  # large: a failure, never a threshold
    assert reads.floor == 0
    reads.skipped(30)
    assert reads.floor == VLLM_RECOMPUTE_THRESHOLD  # vLLM's default from then on
    assert not worth.pays(63, reads.floor) and worth.pays(64, reads.floor)
    reads.skipped(100)  # a P whose threshold is above the default
    assert reads.floor == 101


def test_what_p_keeps_is_learned_and_forgotten_on_restart() -> None:
    reads = Reads()
    reads.cached(None, 32)  # P does not report cached tokens: nothing is known
    assert reads.kept == 1.0
    reads.cached(0, 32)
    assert reads.kept == pytest.approx(0.7)
    reads.cached(None, 32)  # P reported before: none now means none cached
    assert reads.kept == pytest.approx(0.49)
    reads.cached(32, 32)
    assert reads.kept == pytest.approx(0.643)
    reads.skipped(10)
    reads.skipped(10)
    assert reads.current(0) is reads and reads.floor == VLLM_RECOMPUTE_THRESHOLD
    assert reads.current(1).floor == 0 and reads.kept == 1.0  # P restarted
