"""What moved (issue 50, item 3): a hit judged by what P holds since the conversation's last
turn and by what P counts cached after its leg (pure tables)."""

from __future__ import annotations

from typing import Any

import pytest

from router.connectors.legs.moved import prompt_counts
from router.engines.kv_index import EngineIndex
from router.turn.decide import holds
from router.turn.kv_aware import events_held
from router.turn.outcomes import Found, Reason, Reuse, Via
from sessions.model import SessionState

P = "http://p0:8000"
PC = Via.PREFILL_CACHE


@pytest.mark.parametrize(
    ("reuse", "cached", "expected"),
    [
        (Reuse.hit(40), None, Reuse.hit(40)),  # no count: nothing is known
        (Reuse.hit(40), 40, Reuse.hit(40)),  # a read brings the count up to the handle's
        (Reuse.hit(40), 90, Reuse.hit(40)),
        (Reuse.hit(40), 32, Reuse.hit(32, PC)),  # read skipped (under the threshold)
        (Reuse.hit(40, found=Found.HISTORY), 32, Reuse.hit(32, PC, Found.HISTORY)),
        (Reuse.hit(40), 0, Reuse.miss(Reason.RECOMPUTED)),  # failed, recompute policy
        (Reuse.hit(40, PC), 32, Reuse.hit(40, PC)),  # P's cache: whole blocks of 16
        (Reuse.hit(40, PC), 16, Reuse.hit(16, PC)),  # evicted some
        (Reuse.hit(40, PC), 0, Reuse.miss(Reason.RECOMPUTED)),  # evicted all, or restarted
        (Reuse.hit(40, Via.DECODE), 0, Reuse.hit(40, Via.DECODE)),  # no P leg
        (Reuse.hit(40, Via.STORE), 0, Reuse.hit(40, Via.STORE)),
        (Reuse.miss(Reason.BUSY), 0, Reuse.miss(Reason.BUSY)),
    ],
)
def test_moved(reuse: Reuse, cached: int | None, expected: Reuse) -> None:
    assert holds.moved(reuse, cached, 16) == expected


@pytest.mark.parametrize(
    ("state", "prefill", "expected"),
    [
        (SessionState(prefill=P, prefill_tokens=45), P, 32),  # its full blocks
        (SessionState(prefill=P, prefill_tokens=45), "http://p1:8000", 0),  # another P
        (SessionState(prefill=P), P, 0),  # not known (no P leg, or an older session)
        (SessionState(prefill_tokens=45), "", 0),
    ],
)
def test_since_last_turn(state: SessionState, prefill: str, expected: int) -> None:
    assert holds.since_last_turn(state, prefill, 16) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"usage": {"prompt_tokens": 50, "prompt_tokens_details": {"cached_tokens": 32}}},
            (50, 32),
        ),
        ({"usage": {"prompt_tokens": 50}}, (50, None)),  # without the details: not known
        ({"usage": {"prompt_tokens": 50, "prompt_tokens_details": None}}, (50, None)),
        ({"usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}}}, (9, 0)),
        (
            {"usage": {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": -1}}},
            (None, None),
        ),
        ({}, (None, None)),
    ],
)
def test_prompt_counts(body: dict[str, Any], expected: tuple[int | None, int | None]) -> None:
    assert prompt_counts(body) == expected


def index_of(tokens: list[int], size: int) -> EngineIndex:
    """An index in sync that holds these tokens' full blocks."""
    index = EngineIndex(stale=False)
    hashes = list(range(100, 100 + len(tokens) // size))
    index.apply(
        [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": tokens[: len(hashes) * size],
                "block_size": size,
            }
        ],
        now=1.0,
    )
    return index


def testevents_held_trusts_the_last_turn_unless_p_evicted() -> None:
    tokens = list(range(40))
    assert events_held(None, tokens, 32, since=5.0) == 32  # no events for P
    assert events_held(EngineIndex(), tokens, 32, since=5.0) == 32  # not in sync
    behind = index_of(tokens[:16], 4)  # its events of the last turn not applied yet
    assert events_held(behind, tokens, 32, since=5.0) == 32
    assert events_held(index_of(tokens, 4), tokens, 0, since=5.0) == 40  # held by events
    evicted = index_of(tokens, 4)
    evicted.apply([{"type": "BlockRemoved", "block_hashes": [105, 106, 107]}], now=9.0)
    assert events_held(evicted, tokens, 32, since=5.0) == 20
