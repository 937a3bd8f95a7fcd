"""Digest chains: stable across versions and hosts, sensitive to every rendered edit."""

from __future__ import annotations

import random
from typing import Any

import pytest

from sessions.digests import (
    block_digests,
    canonical_message,
    conversation_digest,
    extend_block_digests,
    pack_token_ids,
    sequence_digest,
    sequence_digests,
    text_digest,
)

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello there"}

# Digests live in Redis across router upgrades and replicas: changing them is a migration.
GOLDEN = [
    (lambda: conversation_digest("chat", [USER]), "1988fa398134cf165b5d7ccf9c267e21"),
    (lambda: text_digest("completions", "hello"), "959036481d10005d76050c7bfbf53be7"),
    (lambda: block_digests(list(range(8)), 4), ("2818b2c042ce0e3c", "cf68f5f93b1a8c26")),
    (
        lambda: extend_block_digests(("2818b2c042ce0e3c",), list(range(8)), 4),
        ("2818b2c042ce0e3c", "cf68f5f93b1a8c26"),
    ),
    (lambda: sequence_digest([1, 2, 3]), "9a41751a058abca9cd551974b6b7af79"),
]


@pytest.mark.parametrize(("compute", "expected"), GOLDEN)
def test_digests_are_pinned(compute: Any, expected: object) -> None:
    assert compute() == expected


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (USER, USER),
        # What an SDK echoes back: null and empty extras vanish.
        (
            {"role": "assistant", "content": "x", "refusal": None, "tool_calls": [], "audio": None},
            {"role": "assistant", "content": "x"},
        ),
        ({"role": "assistant", "content": None, "annotations": []}, {"role": "assistant"}),
        ({"role": "assistant", "content": []}, {"role": "assistant"}),
        # "" renders as an empty text part, unlike a missing content: kept.
        ({"role": "assistant", "content": ""}, {"role": "assistant", "content": ""}),
        (
            {"role": "user", "content": [{"type": "text", "text": "x", "cache": None}]},
            {"role": "user", "content": [{"type": "text", "text": "x"}]},
        ),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
                "reasoning_content": "think",
            },
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
                "reasoning_content": "think",
            },
        ),
        (
            {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"},
            {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"},
        ),
        (
            {"role": "user", "content": "x", "name": "", "reasoning": ""},
            {"role": "user", "content": "x"},
        ),
        # A role and a text content only (the short path) read as the rest do.
        ({"role": "", "content": "x"}, {"content": "x"}),
        ({"content": "x"}, {"content": "x"}),
        ({"role": None, "content": "x"}, {"content": "x"}),
        ({"role": "user", "content": "x", "extra": 1}, {"role": "user", "content": "x"}),
        (
            {"role": "user", "content": "x", "name": "n"},
            {"role": "user", "content": "x", "name": "n"},
        ),
    ],
)
def test_canonical_message(message: dict[str, Any], expected: dict[str, Any]) -> None:
    before = repr(message)
    assert canonical_message(message) == expected
    assert repr(message) == before  # never mutates


def test_echoed_assistant_message_matches_recorded() -> None:
    recorded = [USER, {"role": "assistant", "content": "hello there"}]
    echoed = [
        {"role": "user", "content": "hi", "name": None},
        {"content": "hello there", "role": "assistant", "refusal": None, "tool_calls": []},
    ]
    assert conversation_digest("chat", recorded) == conversation_digest("chat", echoed)


@pytest.mark.parametrize(
    "edited",
    [
        [USER, {"role": "assistant", "content": "hello there!"}],  # edited content
        [USER, {"role": "user", "content": "hello there"}],  # changed role
        [ASSISTANT, USER],  # reordered
        [USER],  # truncated
        [USER, ASSISTANT, USER],  # extended
        [USER, {"role": "assistant", "content": [{"type": "text", "text": "hello there"}]}],
        [USER, {**ASSISTANT, "reasoning_content": "hmm"}],  # reasoning rendered by some templates
        [USER, {**ASSISTANT, "name": "bot"}],
        [USER, {"role": "assistant", "content": ""}],
    ],
)
def test_conversation_digest_is_sensitive(edited: list[dict[str, Any]]) -> None:
    assert conversation_digest("chat", edited) != conversation_digest("chat", [USER, ASSISTANT])


def test_conversation_digest_is_seeded_by_api_and_key_order_free() -> None:
    items = [{"type": "message", "role": "user", "content": "hi"}]
    assert conversation_digest("responses", items) != conversation_digest("chat", items)
    assert conversation_digest("chat", []) != conversation_digest("responses", [])
    reordered = [{"content": "hi", "role": "user", "type": "message"}]
    assert conversation_digest("responses", items) == conversation_digest("responses", reordered)
    # Responses items keep their fields (only nulls go): an id is part of the item.
    with_id = [{**items[0], "id": "msg_1"}]
    assert conversation_digest("responses", with_id) != conversation_digest("responses", items)
    assert conversation_digest("responses", [{**items[0], "id": None}]) == conversation_digest(
        "responses", items
    )


def test_text_digest() -> None:
    assert text_digest("completions", "abc") == text_digest("completions", "abc")
    assert text_digest("completions", "abc") != text_digest("completions", "abd")
    assert text_digest("completions", "abc") != text_digest("chat", "abc")
    assert len(text_digest("completions", "\ud800 surrogate")) == 32


@pytest.mark.parametrize(
    ("tokens", "size", "count"),
    [([], 4, 0), ([1, 2, 3], 4, 0), ([1, 2, 3, 4], 4, 1), (list(range(11)), 4, 2), ([1], 0, 0)],
)
def test_block_digests_cover_full_blocks_only(tokens: list[int], size: int, count: int) -> None:
    digests = block_digests(tokens, size)
    assert len(digests) == count
    assert all(len(d) == 16 and int(d, 16) >= 0 for d in digests)


def test_block_digests_are_chained() -> None:
    a = block_digests([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_digests([9, 2, 3, 4, 5, 6, 7, 8], 4)
    # Same second block, different first: chaining makes every later digest differ too.
    assert a[0] != b[0] and a[1] != b[1]
    assert block_digests([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # a partial tail adds nothing
    assert block_digests([1, 2, 3, 4, 5, 6, 7, 9], 4)[0] == a[0]


def test_sequence_digest() -> None:
    assert sequence_digest([1, 2, 3]) != sequence_digest([1, 2, 3, 0])
    assert sequence_digest([]) != sequence_digest([0])
    assert sequence_digest([2**40, -1]) == sequence_digest((2**40, -1))
    assert len(sequence_digest(range(1000))) == 32


def test_token_ids_pack_as_little_endian_int64_and_refuse_what_does_not_fit() -> None:
    assert pack_token_ids([1, -1, 2**63 - 1]) == (
        b"\x01" + b"\x00" * 7 + b"\xff" * 8 + b"\xff" * 7 + b"\x7f"
    )
    assert pack_token_ids([]) == b""
    with pytest.raises(OverflowError, match="not int64"):
        pack_token_ids([2**63])  # a uint64 that msgspec's list[int] lets through


@pytest.mark.parametrize("size", [1, 3, 16])
def test_extending_known_block_digests_gives_them_all(size: int) -> None:
    rng = random.Random(size)
    for _ in range(40):
        tokens = [rng.randrange(1 << 40) for _ in range(rng.randrange(0, 100))]
        full = block_digests(tokens, size)
        for known in range(len(full) + 1):
            assert extend_block_digests(full[:known], tokens, size) == full
        assert extend_block_digests((*full, "0123456789abcdef"), tokens, size) == full


def test_extending_goes_on_from_the_last_known_digest() -> None:
    """The known digests are taken as they are (the caller vouches for them), not hashed
    again: the chain goes on from the last of them."""
    tokens = list(range(12))
    other = block_digests([7, *tokens[1:]], 4)  # another first block: every digest differs
    assert other[0] != block_digests(tokens, 4)[0]
    extended = extend_block_digests(other[:2], tokens, 4)
    assert extended[:2] == other[:2] and extended[2] == other[2]  # same third block, same chain
    assert extend_block_digests(other[:1], tokens, 4)[1] == other[1]


@pytest.mark.parametrize("known", [("zz",), ("abcd",), ("2818b2c042ce0e3c00",)])
def test_extending_refuses_what_is_not_a_block_digest(known: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        extend_block_digests(known, list(range(8)), 4)


def test_sequence_digests_give_a_prefix_and_the_whole_in_one_pass() -> None:
    tokens = list(range(40, 80))
    for at in range(len(tokens) + 1):
        assert sequence_digests(tokens, at) == (
            sequence_digest(tokens[:at]),
            sequence_digest(tokens),
        )
