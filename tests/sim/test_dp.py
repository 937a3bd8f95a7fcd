"""`--data-parallel-size N`: N ranks behind one API server, each with its own prefix cache,
engine id `<id>_dp<rank>` and side channel; `X-data-parallel-rank` picks one."""

from __future__ import annotations

from typing import Any

from tests.sim.client import get, post, words
from tests.sim.conftest import running


async def ask(url: str, rank: int | None, content: str, **extra: Any) -> tuple[int, Any]:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return await post(url + "/v1/chat/completions", body, headers=headers)


def cached(body: Any) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_each_rank_has_its_own_prefix_cache_and_engine_id() -> None:
    async with running(data_parallel_size=2, bidirectional=True) as s:
        _, state = await get(s.url + "/sim/state")
        ranks = state["ranks"]
        engine_id = s.sim.settings.engine_id
        assert [r["engine_id"] for r in ranks] == [f"{engine_id}_dp0", f"{engine_id}_dp1"]
        assert ranks[0]["kv_port"] != ranks[1]["kv_port"]
        text = words(7, 80)
        status, first = await ask(s.url, 0, text)
        assert status == 200 and cached(first) == 0
        _, again = await ask(s.url, 0, text)
        assert cached(again) >= 64  # right rank: its prefix cache holds the prompt
        _, other = await ask(s.url, 1, text)
        assert cached(other) == 0  # wrong rank: a miss
        assert other["choices"][0]["message"] == again["choices"][0]["message"]
        # A D-style handle names the rank that made it, at that rank's side channel.
        kv = {"do_remote_decode": False, "do_remote_prefill": False}
        _, made = await ask(s.url, 1, text + " more", kv_transfer_params=kv)
        params = made["kv_transfer_params"]
        assert params["remote_engine_id"] == f"{engine_id}_dp1"
        assert params["remote_port"] == ranks[1]["kv_port"]


async def test_a_rank_out_of_range_is_a_400() -> None:
    async with running(data_parallel_size=2) as s:
        status, body = await ask(s.url, 2, "hello")
        assert status == 400, body
        assert "out of range" in body["error"]["message"]
        status, _ = await ask(s.url, None, "hello")
        assert status == 200
