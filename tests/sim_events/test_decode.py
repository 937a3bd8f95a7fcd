"""decode_batch and the event structs: pure tables, no sockets."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from vllm_sim.events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm_sim.events_decode import decode_batch

BIG = 2**64 - 1  # uint64 block hashes may exceed 2**63

STORED_MAP: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [BIG, 5],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
    "extra_keys": [None, None],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
}
REMOVED_MAP: dict[str, Any] = {
    "type": "BlockRemoved",
    "block_hashes": [2**63],
    "medium": "GPU",
    "group_idx": 0,
}


def _enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_structs_encode_like_measured_vllm_0_32() -> None:
    events = [
        BlockStored([BIG, 5], None, [1, 2, 3, 4], 2),
        BlockRemoved([2**63]),
        AllBlocksCleared(),
    ]
    decoded = msgspec.msgpack.decode(_enc(events))
    assert decoded == [STORED_MAP, REMOVED_MAP, {"type": "AllBlocksCleared"}]
    assert list(decoded[0]) == list(STORED_MAP)  # tag first, then field order
    assert list(decoded[1]) == list(REMOVED_MAP)


def test_block_stored_keeps_explicit_extra_keys() -> None:
    event = BlockStored([1, 2], 9, [0] * 4, 2, extra_keys=[("salt",), None], lora_name="a")
    assert event.extra_keys == [("salt",), None]
    assert msgspec.msgpack.decode(_enc(event))["extra_keys"] == [["salt"], None]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(
            [1.5, [STORED_MAP, REMOVED_MAP, {"type": "AllBlocksCleared"}], 0],
            (
                1.5,
                [
                    # Omitted defaulted fields are filled with None.
                    {**STORED_MAP, "kv_cache_spec_sliding_window": None},
                    REMOVED_MAP,
                    {"type": "AllBlocksCleared"},
                ],
                0,
            ),
            id="maps-vllm-0.32",
        ),
        pytest.param(
            # Before vllm#42892: array_like events, tag first, trailing defaults omitted.
            [2, [["BlockStored", [BIG], 7, [1, 2], 2, None, "GPU"], ["BlockRemoved", [3]]], 1],
            (
                2.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [BIG],
                        "parent_block_hash": 7,
                        "token_ids": [1, 2],
                        "block_size": 2,
                        "lora_id": None,
                        "medium": "GPU",
                        "lora_name": None,
                        "extra_keys": None,
                        "group_idx": None,
                        "kv_cache_spec_kind": None,
                        "kv_cache_spec_sliding_window": None,
                    },
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [3],
                        "medium": None,
                        "group_idx": None,
                    },
                ],
                1,
            ),
            id="positional-pre-42892",
        ),
        pytest.param(
            [3.0, [["AllBlocksCleared"], {"type": "FutureEvent", "x": 1}]],
            (3.0, [{"type": "AllBlocksCleared"}, {"type": "FutureEvent", "x": 1}], None),
            id="no-dp-rank-unknown-type",
        ),
        pytest.param(
            {"ts": 4.0, "events": [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]}]},
            (
                4.0,
                [
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [b"\x01" * 32],
                        "medium": None,
                        "group_idx": None,
                    }
                ],
                None,
            ),
            id="map-batch-bytes-hashes",
        ),
        pytest.param([5.0, [], 2], (5.0, [], 2), id="empty"),
    ],
)
def test_decode_batch(raw: Any, expected: tuple[float, list[dict[str, Any]], int | None]) -> None:
    assert decode_batch(_enc(raw)) == expected


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\xc1", id="not-msgpack"),
        pytest.param(_enc(42), id="scalar"),
        pytest.param(_enc([1.0]), id="too-short"),
        pytest.param(_enc([1.0, "x", 0]), id="events-not-a-list"),
        pytest.param(_enc(["t", [], 0]), id="ts-not-a-number"),
        pytest.param(_enc([1.0, [7], 0]), id="event-not-a-map"),
        pytest.param(_enc([1.0, [{"block_hashes": [1]}], 0]), id="event-without-type"),
        pytest.param(_enc([1.0, [[]], 0]), id="empty-positional-event"),
    ],
)
def test_decode_batch_rejects(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)
