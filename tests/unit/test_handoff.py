"""NixlConnector pull-mode kv_transfer_params: null handoff, hit params, truncation, checks."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from harness.chat import NULL_HANDOFF as WIRE_NULL_HANDOFF
from router.config import Settings
from router.connectors.base import Connector, engine_id, prefill_failed
from router.connectors.nixl.connector import NixlPull
from router.connectors.nixl.params import (
    NULL_HANDOFF,
    hit_params,
    is_handle,
    miss_params,
    pinned,
    truncate,
)
from router.connectors.select import select
from sessions.model import PinSize
from tests.unit.handles import D_HANDLE

# P's params (vllm-cpu README section 4a).
P_PARAMS: dict[str, Any] = {
    **D_HANDLE,
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9]],
    "remote_port": 5600,
    "remote_num_tokens": 269,
    "remote_blocks_expiry_time": None,
    "remote_prefill_cached_tokens": 256,
}


def test_nixl_pull_is_the_connector_for_nixl() -> None:
    connector: Connector[Any] = select(Settings(prefill=("http://p",), decode=("http://d",)))
    assert isinstance(connector, NixlPull)
    assert connector.caps.reuses_d_to_p and connector.caps.pins_on_d
    assert connector.prefill_params(None) == miss_params()
    assert connector.prefill_params(D_HANDLE) == hit_params(D_HANDLE)


def test_null_handoff_and_miss_params() -> None:
    expected = dict(WIRE_NULL_HANDOFF)  # vLLM's null handoff, as the tests write it
    assert dict(NULL_HANDOFF) == expected
    with pytest.raises(TypeError):
        NULL_HANDOFF["remote_port"] = 1  # type: ignore[index]
    a, b = miss_params(), miss_params()
    assert a == b == expected and a is not b
    a["x"] = 1
    assert miss_params() == expected
    assert not is_handle(miss_params())


@pytest.mark.parametrize(
    ("handle", "expected"),
    [
        (D_HANDLE, D_HANDLE),
        (
            {**D_HANDLE, "do_remote_decode": False, "do_remote_prefill": True},
            D_HANDLE,
        ),
        (
            {**D_HANDLE, "_remote_blocks_processed": True, "_p_side_truncated": 3},
            D_HANDLE,
        ),
        ({"remote_block_ids": [[1]]}, {"remote_block_ids": [[1]]}),
    ],
)
def test_hit_params(handle: dict[str, Any], expected: dict[str, Any]) -> None:
    before = copy.deepcopy(handle)
    out = hit_params(handle)
    assert out == {**expected, "do_remote_decode": True, "do_remote_prefill": False}
    assert handle == before
    out["remote_block_ids"][0].append(99)
    assert handle == before  # block lists are copies, not shared


@pytest.mark.parametrize(
    ("params", "tokens", "block_size", "groups"),
    [
        (D_HANDLE, 299, 32, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]),  # no truncation
        (D_HANDLE, 288, 32, [[1, 2, 3, 4, 5, 6, 7, 8, 9]]),
        (D_HANDLE, 32, 32, [[1]]),
        (D_HANDLE, 64, 16, [[1, 2, 3, 4]]),
        ({**D_HANDLE, "remote_num_tokens": 545}, 480, 32, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]),
        (
            {
                **D_HANDLE,
                "remote_block_ids": [[1, 2, 3, 4], [7, 8, 9, 10]],
                "remote_num_tokens": 100,
            },
            64,
            32,
            [[1, 2], [7, 8]],
        ),
        (
            {**D_HANDLE, "remote_block_ids": [[1, 2, 3, 4], [7]], "remote_num_tokens": 100},
            64,
            32,
            [[1, 2], [7]],
        ),
        ({**D_HANDLE, "_p_side_truncated": 1}, 96, 32, [[1, 2, 3]]),
    ],
)
def test_truncate(
    params: dict[str, Any], tokens: int, block_size: int, groups: list[list[int]]
) -> None:
    before = copy.deepcopy(params)
    out = truncate(params, tokens, block_size)
    assert out["remote_num_tokens"] == tokens
    assert out["remote_block_ids"] == groups
    rest = {k: v for k, v in params.items() if not k.startswith("_")}
    assert {k: v for k, v in out.items() if k not in ("remote_num_tokens", "remote_block_ids")} == {
        k: v for k, v in rest.items() if k not in ("remote_num_tokens", "remote_block_ids")
    }
    assert params == before
    assert is_handle(out)


@pytest.mark.parametrize(
    ("params", "tokens", "block_size", "message"),
    [
        (D_HANDLE, 100, 32, "multiple"),
        (D_HANDLE, 0, 32, "positive multiple"),
        (D_HANDLE, -32, 32, "positive multiple"),
        (D_HANDLE, 320, 32, "below remote_num_tokens"),
        (D_HANDLE, 64, 0, "block_size must be positive"),
        ({**D_HANDLE, "remote_num_tokens": None}, 64, 32, "no integer remote_num_tokens"),
        ({**D_HANDLE, "remote_num_tokens": True}, 64, 32, "no integer remote_num_tokens"),
    ],
)
def test_truncate_rejects(
    params: dict[str, Any], tokens: int, block_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        truncate(params, tokens, block_size)


@pytest.mark.parametrize(
    ("params", "ok"),
    [
        (D_HANDLE, True),
        (P_PARAMS, True),
        ({k: v for k, v in P_PARAMS.items() if k != "remote_num_tokens"}, True),  # pre #32553 P
        ({k: v for k, v in D_HANDLE.items() if k != "remote_num_tokens"}, False),
        ({**D_HANDLE, "remote_num_tokens": -1}, False),
        ({**D_HANDLE, "remote_num_tokens": 0}, True),
        ({**D_HANDLE, "remote_num_tokens": "299"}, False),
        ({**D_HANDLE, "remote_block_ids": []}, False),
        ({**D_HANDLE, "remote_block_ids": [[]]}, False),
        ({**D_HANDLE, "remote_block_ids": [[], [3]]}, True),
        ({**D_HANDLE, "remote_block_ids": [1, 2]}, False),
        ({**D_HANDLE, "remote_block_ids": [[1, "2"]]}, False),
        ({**D_HANDLE, "remote_block_ids": [[1, True]]}, False),
        ({**D_HANDLE, "remote_block_ids": None}, False),
        ({**D_HANDLE, "remote_engine_id": None}, False),
        ({**D_HANDLE, "remote_engine_id": ""}, False),
        ({**D_HANDLE, "remote_request_id": 5}, False),
        ({**D_HANDLE, "remote_host": None}, False),
        ({**D_HANDLE, "remote_port": "5601"}, False),
        ({**D_HANDLE, "remote_port": 0}, False),
        ({**D_HANDLE, "remote_port": 70000}, False),
        ({**D_HANDLE, "remote_port": True}, False),
        (dict(NULL_HANDOFF), False),
        (None, False),
        ([D_HANDLE], False),
        ("{}", False),
    ],
)
def test_is_handle(params: object, ok: bool) -> None:
    assert is_handle(params) is ok


@pytest.mark.parametrize(
    ("params", "engine"),
    [
        (D_HANDLE, "da455c08"),
        (P_PARAMS, "da455c08"),
        ({}, None),
        ({"remote_engine_id": 3, "remote_num_tokens": "9"}, None),
        ({"remote_num_tokens": False}, None),
    ],
)
def test_engine_id(params: dict[str, Any], engine: str | None) -> None:
    assert engine_id(params) == engine


@pytest.mark.parametrize(
    ("status", "body", "failed"),
    [
        (200, {"choices": [{"index": 0, "finish_reason": "length"}]}, False),
        (200, {"choices": [{"index": 0, "finish_reason": "stop"}]}, False),
        (200, {"choices": [{"index": 0, "finish_reason": "error"}]}, True),
        (200, {"choices": [{"index": 0}, {"index": 1, "finish_reason": "error"}]}, True),
        (200, {"choices": "bad"}, False),
        (200, {"choices": ["bad"]}, False),
        (200, None, False),
        (200, {}, False),
        (200, {"error": {"message": "x"}}, True),
        (200, {"object": "response", "status": "failed"}, True),
        (200, {"object": "response", "status": "completed"}, False),
        (400, None, True),
        (500, {"choices": [{"finish_reason": "length"}]}, True),
        (503, {}, True),
    ],
)
def test_prefill_failed(status: int, body: dict[str, Any] | None, failed: bool) -> None:
    assert prefill_failed(status, body) is failed


@pytest.mark.parametrize(
    ("handle", "size"),
    [
        (D_HANDLE, PinSize(10, 299, " ".join(f"0:{b}" for b in range(1, 11)))),
        # Groups share their engine's block pool: an id is one block whichever group lists it.
        (
            {**D_HANDLE, "remote_block_ids": [[4, 5], [], [9, 4]]},
            PinSize(4, 299, "0:4 0:5 0:9 0:4"),
        ),
        # Each data-parallel rank (`_dp<rank>` ends its engine id) has a pool of its own.
        (
            {**D_HANDLE, "remote_engine_id": "da455c08_dp12"},
            PinSize(10, 299, " ".join(f"12:{b}" for b in range(1, 11))),
        ),
        ({**D_HANDLE, "remote_block_ids": [[1, "2"]]}, PinSize(2, 299)),  # not ids: none named
        ({**D_HANDLE, "remote_block_ids": [[1, True]]}, PinSize(2, 299)),
        ({**D_HANDLE, "remote_block_ids": [[]]}, PinSize(0, 299)),
        (
            {**D_HANDLE, "remote_num_tokens": None},
            PinSize(10, 0, " ".join(f"0:{b}" for b in range(1, 11))),
        ),
        (dict(NULL_HANDOFF), PinSize()),
        ({}, PinSize()),
    ],
)
def test_what_a_handle_pins_on_d(handle: dict[str, Any], size: PinSize) -> None:
    assert pinned(handle) == size
    connector = select(Settings(prefill=("http://p",), decode=("http://d",)))
    assert connector.pinned(handle) == size
