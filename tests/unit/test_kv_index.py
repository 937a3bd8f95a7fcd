"""The KV-events index, the event decoder and the decisions that use them (pure tables)."""

from __future__ import annotations

import msgspec
import pytest

from router.engines.kv_events import decode_batch
from router.engines.kv_index import EngineIndex, block_digests, held_tokens
from router.engines.kv_watch import parse_sources
from router.engines.pool import Instance
from router.errors import ConfigError
from router.turn.decide import holds
from router.turn.outcomes import Reason, Reuse, Via

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: object) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        **extra,
    }


def synced() -> EngineIndex:
    index = EngineIndex()
    index.stale = False
    return index


def test_digests_chain_over_full_blocks_only() -> None:
    a = block_digests(list(range(10)), BS)
    assert len(a) == 2
    assert block_digests(list(range(8)), BS) == a
    assert block_digests([99, *range(1, 10)], BS)[1] != a[1]  # the chain carries the parent
    assert block_digests(list(range(10)), BS, limit=1) == a[:1]


def test_stored_blocks_chain_across_events_and_answer_prefixes() -> None:
    index = synced()
    tokens = list(range(16))
    index.apply([stored([11, 12], None, tokens[:8])], now=1.0)
    index.apply([stored([13], 12, tokens[8:12])], now=1.0)
    assert index.blocks == 3
    assert held_tokens(index, tokens) == 12
    assert held_tokens(index, [0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert held_tokens(index, [7, *tokens[1:]]) == 0


def test_an_unknown_parent_is_not_chained_and_stale_claims_nothing() -> None:
    index = synced()
    index.apply([stored([21], 999, [1, 2, 3, 4])], now=1.0)
    assert index.blocks == 0 and index.unchained == 1
    index.apply([stored([11], None, [1, 2, 3, 4])], now=1.0)
    index.stale = True
    assert held_tokens(index, [1, 2, 3, 4, 5]) == 0


@pytest.mark.parametrize(
    "extra", [{"lora_name": "x"}, {"group_idx": 1}, {"medium": "CPU"}, {"extra_keys": [["img"]]}]
)
def test_blocks_of_other_kv_are_not_text_prefixes(extra: dict) -> None:
    index = synced()
    index.apply([stored([11], None, [1, 2, 3, 4], **extra)], now=1.0)
    assert index.blocks == 0


def test_removed_and_cleared_blocks_are_gone_and_count_as_evicted_after() -> None:
    index = synced()
    tokens = list(range(8))
    index.apply([stored([11, 12], None, tokens)], now=1.0)
    digests = block_digests(tokens, BS)
    assert not index.evicted_since(digests, made_at=1.5)
    index.apply([{"type": "BlockRemoved", "block_hashes": [12]}], now=2.0)
    assert held_tokens(index, tokens) == 4
    assert index.evicted_since(digests, made_at=1.5)
    assert not index.evicted_since(digests, made_at=2.5)  # evicted before the handle
    index.apply([{"type": "AllBlocksCleared"}], now=3.0)
    assert index.blocks == 0 and index.evicted_since(digests, made_at=2.5)
    index.apply([{"type": "SomethingNew", "x": 1}], now=4.0)  # ignored


def test_the_index_is_bounded_oldest_first() -> None:
    index = synced()
    index.max_blocks = 2
    index.apply([stored([1, 2, 3], None, list(range(12)))], now=1.0)
    assert index.blocks == 2
    assert held_tokens(index, list(range(12))) == 0  # the first block went: no prefix


def test_decode_map_and_positional_events_and_extra_fields() -> None:
    enc = msgspec.msgpack.encode
    maps = [1.5, [{"type": "BlockRemoved", "block_hashes": [2**64 - 1], "new": 1}], 0]
    assert decode_batch(enc(maps)) == (1.5, maps[1])
    positional = [2.0, [["BlockStored", [5], None, [1, 2, 3, 4], 4], ["AllBlocksCleared"], 7]]
    ts, events = decode_batch(enc(positional))
    assert ts == 2.0 and events[0]["token_ids"] == [1, 2, 3, 4] and len(events) == 2
    assert events[1] == {"type": "AllBlocksCleared"}
    assert decode_batch(enc({"ts": 3.0, "events": []})) == (3.0, [])
    with pytest.raises(ValueError):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError):
        decode_batch(enc([1.0]))


@pytest.mark.parametrize(
    ("verified", "p_held", "evicted", "expected"),
    [
        (Reuse.hit(40), 32, False, Reuse.hit(40, Via.PREFILL_CACHE)),  # the tail is computed
        (Reuse.hit(40), 16, False, Reuse.hit(40)),
        (Reuse.hit(40), 16, True, Reuse.miss(Reason.EVICTED)),
        (Reuse.hit(40), 48, True, Reuse.hit(40, Via.PREFILL_CACHE)),
        (Reuse.hit(8), 8, False, Reuse.hit(8)),  # less than a block: nothing to compare
        (Reuse.miss(Reason.BUSY), 99, True, Reuse.miss(Reason.BUSY)),
    ],
)
def test_cached_reuse(verified: Reuse, p_held: int, evicted: bool, expected: Reuse) -> None:
    assert holds.cached_reuse(verified, 16, p_held=p_held, d_evicted=evicted) == expected


def test_prefill_cache_header_label_and_source() -> None:
    reuse = Reuse.hit(40, Via.PREFILL_CACHE)
    assert reuse.header() == "hit;via=prefill-cache"
    assert reuse.labels() == ("hit", "via=prefill-cache")
    assert (reuse.source, Reuse.hit(3).source, Reuse.miss(Reason.BUSY).source) == (
        "prefill_cache",
        "decode_pull",
        "",
    )
    assert reuse.is_hit and not reuse.pulls and Reuse.hit(3).pulls


def test_prefix_placement_within_the_load_limit() -> None:
    a, b, c = (Instance(u, "prefill") for u in ("a", "b", "c"))
    assert holds.prefix_placement([(a, 0), (b, 64)], a, 8) is b
    assert holds.prefix_placement([(a, 0), (b, 0)], a, 8) is a
    assert holds.prefix_placement([(a, 64), (b, 64)], a, 8) is a
    b.outstanding = 9
    assert holds.prefix_placement([(a, 0), (b, 64), (c, 32)], a, 8) is c
    assert holds.prefix_placement([], a, 8) is a


def test_parse_sources() -> None:
    got = parse_sources(
        ["10.0.0.1:8000=tcp://10.0.0.1:5557", "http://h:1=tcp://h:7,tcp://h:9"],
        5600,
        ["http://10.0.0.1:8000", "http://h:1", "http://[::1]:2"],
        "kv",
    )
    assert got["http://10.0.0.1:8000"].replay == "tcp://10.0.0.1:5558"
    assert got["http://h:1"].replay == "tcp://h:9"
    assert got["http://[::1]:2"].endpoint == "tcp://[::1]:5600"
    assert got["http://[::1]:2"].topic == "kv"
    assert parse_sources([], 0, ["http://x:1"], "") == {}
    assert parse_sources(["http://x:1=ipc:///run/p.ipc"], 0, [], "")["http://x:1"].replay == ""
    with pytest.raises(ConfigError):
        parse_sources(["http://x:1=tcp://x"], 0, [], "")
    with pytest.raises(ConfigError):
        parse_sources(["http://x:1"], 0, [], "")
