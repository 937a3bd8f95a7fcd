"""Data-parallel ranks (`--data-parallel-size`): a D with two ranks (two prefix caches) behind
one URL, in push mode. The router keeps each conversation on one rank with
X-data-parallel-rank (stored in its session), spreads new conversations over the ranks, and
the rank's prefix cache shows it: P writes only the blocks that rank lacks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from harness.chat import chat_turn, client, get_json, reference_answer
from harness.metrics import metric
from harness.router import RouterProc, router
from harness.stack import Stack, start_stack
from tests.e2e.helpers import D_PUSH, PUSH
from tests.sim.client import words


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, RouterProc]]:
    # A redis-server of its own: the session's may hold instances another file's router added
    # (the registry applies them to every router on that Redis), and /status must list one D.
    with start_stack(
        prefill=[PUSH],
        decode=[(*D_PUSH, "--data-parallel-size", "2")],
        reference=(),
        routers=[],
        name="dp",
    ) as st:
        # No --data-parallel-size: the router reads the two ranks off D's /metrics.
        args = ("--kv-connector", "nixl-push")
        with router([st.p.url], [st.d.url], *args, redis_url=st.redis_url, name="dp-router") as r:
            yield st, r


def rank_prompts(st: Stack) -> list[int]:
    return [int(r["prompt_tokens"]) for r in get_json(st.d.url + "/sim/state")["ranks"]]


def conversation(st: Stack, r: RouterProc, seed: str) -> tuple[int, list[float]]:
    """Three turns; (the one rank every D leg ran on, P's blocks written per turn)."""
    used, writes, cid = turns(st, r, seed)
    # Turns 2 and 3 find the earlier turns in their rank's prefix cache: P writes D only the
    # few blocks of the new messages (a turn on the other rank would need them all).
    assert writes[0] >= 7, writes
    assert writes[1] <= 3 and writes[2] <= 3, writes
    assert len(used) == 1, f"{cid}: D legs ran on ranks {used}"
    store = redis.Redis.from_url(st.redis_url or "", decode_responses=True)
    (key,) = store.keys(f"kvbaton:conv:{{*:{cid}}}")
    assert store.hget(key, "decode_rank") == str(next(iter(used)))
    store.close()
    return next(iter(used)), writes


def turns(st: Stack, r: RouterProc, seed: str) -> tuple[set[int], list[float], str]:
    with client(r.base_url) as api:
        cid = f"dp-{seed}-{uuid.uuid4().hex[:6]}"
        system = f"Weather bot {seed}. " + words(len(seed), 120)  # ~8 blocks of prompt on turn 1
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        used: set[int] = set()
        writes = []
        for turn in range(1, 4):
            messages.append({"role": "user", "content": f"Turn {turn} of {seed}: sun or rain?"})
            before, written = (
                rank_prompts(st),
                metric(st.p.url, "vllm_sim:push_blocks_written_total"),
            )
            answer, _, _ = chat_turn(api, messages, cid=cid)
            assert answer == reference_answer(st.ref.url, messages, 24), f"turn {turn}"
            after = rank_prompts(st)
            used |= {i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b}
            writes.append(metric(st.p.url, "vllm_sim:push_blocks_written_total") - written)
            messages.append({"role": "assistant", "content": answer})
        return used, writes, cid


def test_conversations_stay_on_one_rank_and_are_spread(stack: tuple[Stack, RouterProc]) -> None:
    st, r = stack
    (d,) = get_json(r.url + "/status")["instances"]["decode"]
    assert d["data_parallel_size"] == 2  # learned from D's per-engine /metrics series
    rank_a, writes_a = conversation(st, r, "a")
    rank_b, writes_b = conversation(st, r, "b")
    assert rank_a != rank_b  # new conversations go round the ranks
    assert writes_a[0] == writes_b[0]


def test_push_to_a_data_parallel_p_uses_the_rank_its_coordinates_name(
    redis_url_session: str,
) -> None:
    with start_stack(
        prefill=[(*PUSH, "--data-parallel-size", "2")],
        decode=[D_PUSH],
        reference=(),
        routers=[("--kv-connector", "nixl-push")],
        redis=redis_url_session,
        name="dp-p",
    ) as st:
        (p,) = get_json(st.router.url + "/status")["instances"]["prefill"]
        engine_id = p["kv"]["coordinates"]["engine_id"]
        rank = int(engine_id.rsplit("_dp", 1)[1])
        with client(st.router.base_url) as api:
            messages = [{"role": "user", "content": "Two P ranks: frost tonight?"}]
            before = [int(r["prompt_tokens"]) for r in get_json(st.p.url + "/sim/state")["ranks"]]
            for turn in range(3):
                answer, _, _ = chat_turn(api, messages, cid=f"dpp-{uuid.uuid4().hex[:6]}")
                assert answer == reference_answer(st.ref.url, messages, 24), f"turn {turn}"
            after = [int(r["prompt_tokens"]) for r in get_json(st.p.url + "/sim/state")["ranks"]]
            grew = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
            assert grew == [rank]


def test_pull_mode_with_a_data_parallel_d_hits_on_its_rank(redis_url_session: str) -> None:
    """NixlConnector pull with a 2-rank D: D's handle names its rank (engine id `_dp<r>` and
    that rank's side channel), P reads from it, every later turn hits with the right answer,
    and all of a conversation's D legs run on one rank."""
    bidir = ("--bidirectional", "--kv-recompute-threshold", "0")
    with start_stack(
        prefill=[bidir],
        decode=[(*bidir, "--data-parallel-size", "2")],
        reference=(),
        routers=[()],
        redis=redis_url_session.rsplit("/", 1)[0] + "/4",
        name="dp-pull",
    ) as st:
        messages: list[dict[str, Any]] = [{"role": "system", "content": words(3, 100)}]
        used: set[int] = set()
        with client(st.router.base_url) as api:
            for turn in range(1, 4):
                messages.append({"role": "user", "content": f"Pull turn {turn}: fog?"})
                before = rank_prompts(st)
                answer, reuse, _ = chat_turn(api, messages, cid="dp-pull")
                assert answer == reference_answer(st.ref.url, messages, 24), f"turn {turn}"
                assert reuse == ("miss;reason=no-session" if turn == 1 else "hit"), turn
                after = rank_prompts(st)
                used |= {i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b}
                messages.append({"role": "assistant", "content": answer})
        assert len(used) == 1, used
