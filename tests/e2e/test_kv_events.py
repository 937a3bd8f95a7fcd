"""KV events end to end: two simulator P and one D publishing events, a router subscribed.
A `hit` means P read KV from D; `hit;via=prefill-cache` that P held the verified prefix and
got no handle; a first turn goes to the P that holds its prefix; the index follows a restart."""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Iterator

import openai
import pytest

from harness.chat import chat_turn, client
from harness.metrics import metric
from harness.stack import Stack, start_stack
from harness.waiting import scaled
from tests.e2e.conftest import BIDIR, pulled, reference_chat
from tests.e2e.helpers import LONG, events_flags, indexed, spec, status, wait_in_sync


@pytest.fixture(scope="module")
def ports() -> list[tuple[str, ...]]:
    return [events_flags() for _ in range(3)]


@pytest.fixture(scope="module")
def stack(redis_url_session: str, ports: list[tuple[str, ...]]) -> Iterator[Stack]:
    # The router's flags need the engines' URLs: start them first, then the router.
    from harness.router import router

    with start_stack(
        prefill=[(*BIDIR, *ports[0]), (*BIDIR, *ports[1])],
        decode=[(*BIDIR, *ports[2])],
        reference=(),
        routers=[],
        redis=redis_url_session,
        name="kvev",
    ) as st:
        engines = [*st.ps, *st.ds]
        args = [
            a for e, p in zip(engines, ports, strict=True) for a in ("--kv-events", spec(e.url, p))
        ]
        with router([p.url for p in st.ps], [st.d.url], *args, redis_url=redis_url_session) as r:
            st.routers.append(r)
            wait_in_sync(st)
            yield st


@pytest.fixture(scope="module")
def api(stack: Stack) -> Iterator[openai.OpenAI]:
    sdk = client(stack.router.base_url)
    yield sdk
    sdk.close()


def wait_indexed(st: Stack, url: str, more_than: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + scaled(timeout)
    while (n := indexed(st, url)) <= more_than:
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}'s index stayed at {n} blocks")
        time.sleep(0.05)
    return n


def first_turn(st: Stack, api: openai.OpenAI, cid: str, question: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": question}]
    before = [indexed(st, d.url) for d in st.ds]
    answer, reuse, _ = chat_turn(api, messages, cid=cid, max_tokens=40)
    assert reuse == "miss;reason=no-session"
    wait_indexed(st, st.d.url, before[0])  # D's blocks of this turn are known
    return [*messages, {"role": "assistant", "content": answer}]


def p_pulled(st: Stack) -> float:
    return sum(pulled(p.url) for p in st.ps)


def reused(st: Stack, source: str) -> float:
    return metric(st.url, "kvbaton_kv_reused_tokens_total", source=source)


def test_an_answer_that_does_not_verify_is_served_from_ps_own_cache(
    stack: Stack, api: openai.OpenAI
) -> None:
    cid = f"pc-{uuid.uuid4().hex[:8]}"
    history = first_turn(stack, api, cid, "Is the river high today, after the rain?")
    words = history[2]["content"].split(" ")
    edited = " ".join(["Tea", *words[2:]])  # D's answer differs from its first word on
    messages = [*history[:2], {"role": "assistant", "content": edited}]
    messages.append({"role": "user", "content": "And tomorrow?"})
    before, cache = p_pulled(stack), reused(stack, "prefill_cache")
    answer, reuse, _ = chat_turn(api, messages, cid=cid, max_tokens=40)
    assert reuse == "hit;via=prefill-cache"
    assert p_pulled(stack) == before  # no handle was sent: nothing read from D
    assert reused(stack, "prefill_cache") > cache
    assert answer == reference_chat(stack, messages, 40)


def test_an_answer_that_verifies_is_pulled_from_d(stack: Stack, api: openai.OpenAI) -> None:
    cid = f"pull-{uuid.uuid4().hex[:8]}"
    history = first_turn(stack, api, cid, "How cold will the night be?")
    messages = [*history, {"role": "user", "content": "And the morning after that?"}]
    before, pull = p_pulled(stack), reused(stack, "decode_pull")
    answer, reuse, _ = chat_turn(api, messages, cid=cid, max_tokens=40)
    assert reuse == "hit"
    assert p_pulled(stack) > before
    assert reused(stack, "decode_pull") > pull
    assert answer == reference_chat(stack, messages, 40)


def local_hits(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")


def test_a_first_turn_goes_to_the_p_that_holds_its_prefix(stack: Stack, api: openai.OpenAI) -> None:
    seed = f"Where is the old bridge {uuid.uuid4().hex[:6]}?"
    prefix = [{"role": "system", "content": seed + " " + LONG}]  # held by no P yet

    def ask(content: str) -> list[float]:
        hits = [local_hits(p.url) for p in stack.ps]
        chat_turn(api, [*prefix, {"role": "user", "content": content}], cid=None, max_tokens=8)
        return [local_hits(p.url) - h for p, h in zip(stack.ps, hits, strict=True)]

    before = [indexed(stack, p.url) for p in stack.ps]
    assert ask("One.") == [0, 0]
    deadline = time.monotonic() + scaled(5)
    grew = [indexed(stack, p.url) > n for p, n in zip(stack.ps, before, strict=True)]
    while not any(grew):
        assert time.monotonic() < deadline, "no P's index grew"
        time.sleep(0.05)
        grew = [indexed(stack, p.url) > n for p, n in zip(stack.ps, before, strict=True)]
    holder = grew.index(True)
    for n in range(4):  # round robin alone would alternate between the two P
        gained = ask(f"Question {n}?")
        assert gained[holder] > 0 and gained[1 - holder] == 0, (n, gained)


def test_the_index_follows_a_restarted_engine(
    stack: Stack, api: openai.OpenAI, ports: list[tuple[str, ...]]
) -> None:
    p0 = stack.ps[0].url
    wait_in_sync(stack)
    old = status(stack)["kv_events"]["engines"][p0]
    stack.restart("prefill", 0, *ports[0])
    deadline = time.monotonic() + scaled(15)
    while True:  # some turn lands on the restarted P and publishes its blocks
        messages = [{"role": "user", "content": f"Fresh start {uuid.uuid4().hex[:6]}?"}]
        chat_turn(api, messages, cid=None, max_tokens=8)
        view = status(stack)["kv_events"]["engines"][p0]
        if view["rebuilds"] > old["rebuilds"] and view["in_sync"]:
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.2)
    assert view["blocks"] < old["blocks"] or old["blocks"] == 0


def test_a_handle_whose_blocks_d_cleared_is_dropped_before_any_read(
    stack: Stack, api: openai.OpenAI
) -> None:
    cid = f"evict-{uuid.uuid4().hex[:8]}"
    history = first_turn(stack, api, cid, "Will the ferry run in this wind?")
    rebuilt = status(stack)["kv_events"]["engines"][stack.d.url]
    req = urllib.request.Request(stack.d.url + "/reset_prefix_cache", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=5).close()
    deadline = time.monotonic() + scaled(5)
    while indexed(stack, stack.d.url) >= rebuilt["blocks"] and rebuilt["blocks"]:
        assert time.monotonic() < deadline, "D's clear never reached the index"
        time.sleep(0.05)
    messages = [*history, {"role": "user", "content": "And on the way back?"}]
    before = p_pulled(stack)
    answer, reuse, _ = chat_turn(api, messages, cid=cid, max_tokens=40)
    assert reuse == "miss;reason=evicted"
    assert p_pulled(stack) == before
    assert answer == reference_chat(stack, messages, 40)
