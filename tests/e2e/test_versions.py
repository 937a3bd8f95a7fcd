"""vLLM 0.33 and a fleet of 0.32 and 0.33 engines behind one router: versions learned from
the engines (no flag), streamed handles from the first turn, a paused P, a D that slept, and
P/D pairs formed within a connector group."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import openai
import pytest

from harness.chat import Message, chat_turn, client, get_json, post
from harness.metrics import metric
from harness.stack import start_stack
from tests.e2e.conftest import (
    BIDIR,
    V032,
    Stack,
    pd_stack,
    pulled,
    reference_chat,
    streamed_turns,
)

NO_PLAN = ("--decode-local-max-tokens", "0")  # hits are P's reads from D, nothing else


@pytest.fixture(scope="module")
def fresh(redis_url_session: str) -> Iterator[Stack]:
    """0.33 engines (the simulator's default), a router without any stream flag."""
    with pd_stack(redis_url_session, "v033", *NO_PLAN) as st:
        yield st


def test_the_first_streamed_turn_on_033_leaves_a_handle(fresh: Stack) -> None:
    st = fresh
    (d,) = get_json(st.router.url + "/status")["instances"]["decode"]
    assert d["vllm"]["version"] == "0.33.0" and d["vllm"]["streams_handles"] is True
    assert d["vllm"]["connector_group"] == "nixl-v15" and d["streams_params"] is False
    cid = f"v033-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Stream me a story about rivers."}]
    before = pulled(st.p.url)
    reuses = streamed_turns(st, messages, cid, [f"And then, part {t}?" for t in range(2)])
    assert reuses == ["miss;reason=no-session", "hit", "hit"]
    assert pulled(st.p.url) > before  # P read the conversation back from D
    (d,) = get_json(st.router.url + "/status")["instances"]["decode"]
    assert d["vllm"]["registration_generation"] == 1


@pytest.fixture(scope="module")
def two_p(redis_url_session: str) -> Iterator[Stack]:
    """Two 0.33 P, one D."""
    with start_stack(
        prefill=[BIDIR, BIDIR],
        decode=[BIDIR],
        reference=(),
        routers=[NO_PLAN],
        redis=redis_url_session,
        name="paused",
    ) as st:
        yield st


def _served_by(st: Stack, before: list[float]) -> int:
    after = [metric(p.url, "vllm:prompt_tokens_total") for p in st.ps]
    (index,) = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
    return index


def test_a_paused_p_is_busy_not_broken(two_p: Stack) -> None:
    """vLLM 0.33's 503 engine_paused: the turn (and its handle) goes to the other P, nothing
    is ejected or blamed; with every P paused the client gets 503 and Retry-After."""
    st = two_p
    api = client(st.router.base_url)
    cid = f"pause-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Tell me about lighthouses."}]
    counts = [metric(p.url, "vllm:prompt_tokens_total") for p in st.ps]
    answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert answer == reference_chat(st, messages, 24)
    first = _served_by(st, counts)
    paused = st.ps[first]
    assert post(paused.url + "/pause", {}).status == 200
    try:
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        counts = [metric(p.url, "vllm:prompt_tokens_total") for p in st.ps]
        answer, reuse, _ = chat_turn(api, messages, cid=cid)
        assert reuse == "hit"  # the handle went to the other P, unspent
        assert answer == reference_chat(st, messages, 24)
        assert _served_by(st, counts) == 1 - first
        status = get_json(st.router.url + "/status")["instances"]
        p_view = next(p for p in status["prefill"] if p["url"] == paused.url)
        assert p_view["healthy"] is True and p_view["failures"] == 0
        assert status["decode"][0]["reads_paused"] == {}  # D not blamed
        # Every P paused: 503 with Retry-After, in OpenAI's error format.
        other = st.ps[1 - first]
        assert post(other.url + "/pause", {}).status == 200
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                chat_turn(api, [*messages, {"role": "user", "content": "Still there?"}], cid=None)
            assert caught.value.status_code == 503
            assert caught.value.response.headers["retry-after"] == "1"
            assert caught.value.response.headers["x-request-id"]
            assert "paused" in caught.value.response.json()["error"]["message"]
        finally:
            assert post(other.url + "/resume", {}).status == 200
    finally:
        assert post(paused.url + "/resume", {}).status == 200
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again?"}]
    answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "hit" and answer == reference_chat(st, messages, 24)
    assert all(p["healthy"] for p in get_json(st.router.url + "/status")["instances"]["prefill"])


def test_a_d_that_slept_has_its_older_handles_not_read(fresh: Stack) -> None:
    """D re-registers its KV after a sleep (generation 2): a handle of generation 1 names
    blocks of the old registration. Once a handle shows the new generation, the older ones
    are a miss that says why, and the answer is exact."""
    st = fresh
    api = client(st.router.base_url)
    old_cid, new_cid = (f"{n}-{uuid.uuid4().hex[:8]}" for n in ("old", "new"))
    old: list[Message] = [{"role": "user", "content": "Describe a quiet harbour at night."}]
    answer, _, _ = chat_turn(api, old, cid=old_cid)
    old += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    assert post(st.d.url + "/sleep?level=1", {}).status == 200
    assert post(st.d.url + "/wake_up", {}).status == 200
    new: list[Message] = [{"role": "user", "content": "Describe a busy market at noon."}]
    answer, _, _ = chat_turn(api, new, cid=new_cid)  # D's handle now says generation 2
    assert answer == reference_chat(st, new, 24)
    (d,) = get_json(st.router.url + "/status")["instances"]["decode"]
    assert d["vllm"]["registration_generation"] == 2
    answer, reuse, _ = chat_turn(api, old, cid=old_cid)
    assert reuse == "miss;reason=registration-changed"
    assert answer == reference_chat(st, old, 24)


@pytest.fixture(scope="module")
def mixed(redis_url_session: str) -> Iterator[Stack]:
    """A fleet in the middle of an upgrade: a 0.32 P/D pair and a 0.33 P/D pair."""
    with start_stack(
        prefill=[(*BIDIR, *V032), BIDIR],
        decode=[(*BIDIR, *V032), BIDIR],
        reference=(),
        routers=[NO_PLAN],
        redis=redis_url_session,
        name="mixed",
    ) as st:
        yield st


def test_a_mixed_fleet_pairs_within_connector_groups(mixed: Stack) -> None:
    st = mixed
    status = get_json(st.router.url + "/status")
    versions = {
        i["url"]: i["vllm"]["version"]
        for r in ("prefill", "decode")
        for i in status["instances"][r]
    }
    assert versions == {
        st.ps[0].url: "0.32.0",
        st.ds[0].url: "0.32.0",
        st.ps[1].url: "0.33.0",
        st.ds[1].url: "0.33.0",
    }
    groups = status["connector_groups"]
    assert groups["nixl-v14"] == {"prefill": [st.ps[0].url], "decode": [st.ds[0].url]}
    assert groups["nixl-v15"] == {"prefill": [st.ps[1].url], "decode": [st.ds[1].url]}
    engines = [*st.ps, *st.ds]
    failed = sum(metric(e.url, "vllm:nixl_num_failed_transfers_total") for e in engines)
    api = client(st.router.base_url)
    reuses: list[str] = []
    for n in range(50):
        cid = f"mixed-{n}-{uuid.uuid4().hex[:6]}"
        messages: list[Message] = [{"role": "user", "content": f"Conversation {n}: say hello."}]
        for turn in range(2):
            answer, reuse, _ = chat_turn(api, messages, cid=cid, stream=n % 3 == 1, max_tokens=8)
            assert answer == reference_chat(st, messages, 8), (n, turn)
            reuses.append(reuse)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"Turn {turn} of {n}?"},
            ]
    assert sum(metric(e.url, "vllm:nixl_num_failed_transfers_total") for e in engines) == failed
    # Every second turn read its conversation back from D, but after a 0.32 D's stream.
    hits = reuses[1::2]
    assert set(hits) <= {"hit", "miss;reason=stream-no-kv-params"}, hits
    assert hits.count("hit") >= 34, hits
    assert all(
        p["failures"] == 0 for p in get_json(st.router.url + "/status")["instances"]["prefill"]
    )


def test_a_paused_d_is_not_counted_as_failing(fresh: Stack) -> None:
    """D answers 503 while paused: the turn is redone (P's params were single use) and fails
    when D is alone, but D is not ejected or counted as failing; resumed, it serves again."""
    st = fresh
    api = client(st.router.base_url)
    messages: list[Message] = [{"role": "user", "content": "Are the engines awake?"}]
    assert post(st.d.url + "/pause", {}).status == 200
    try:
        for _ in range(4):  # more than --unhealthy-after
            with pytest.raises(openai.APIStatusError) as caught:
                chat_turn(api, messages, cid=None)
            assert caught.value.status_code >= 500
    finally:
        assert post(st.d.url + "/resume", {}).status == 200
    (d,) = get_json(st.router.url + "/status")["instances"]["decode"]
    assert d["healthy"] is True and d["failures"] == 0
    answer, _, _ = chat_turn(api, messages, cid=None)
    assert answer == reference_chat(st, messages, 24)


@pytest.fixture(scope="module")
def watched(redis_url_session: str) -> Iterator[Stack]:
    """0.33 engines, a router that reads D's /metrics every 0.2 s."""
    with pd_stack(redis_url_session, "v033-sleep", *NO_PLAN, "--health-interval", "0.2") as st:
        yield st


def test_a_sleep_seen_on_d_s_metrics_retires_its_older_handles_at_once(watched: Stack) -> None:
    """The health loop sees D asleep with its KV discarded (vllm:engine_sleep_state): the
    conversation's own next turn, the first after the wake-up, does not read its old handle
    (a P that never handshook D would read the discarded blocks: a wrong answer)."""
    st = watched
    api = client(st.router.base_url)
    cid = f"sleep-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Describe the tide coming in."}]
    answer, _, _ = chat_turn(api, messages, cid=cid)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Then?"}]
    assert post(st.d.url + "/sleep?level=1", {}).status == 200
    time.sleep(1.0)  # five health reads
    assert post(st.d.url + "/wake_up", {}).status == 200
    answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "miss;reason=registration-changed"
    assert answer == reference_chat(st, messages, 24)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "hit" and answer == reference_chat(st, messages, 24)
