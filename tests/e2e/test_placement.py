"""Per-turn placement on simulators, through the OpenAI SDK: the decode plan (a streamed chat
turn on stock engines runs on the previous D alone, which computes only the new tokens), its
back-off to P/D under load, and a D learned to stream kv_transfer_params."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from harness.chat import MODEL, Message, chat_turn, client, get_json, post
from harness.metrics import metric
from harness.stack import start_stack
from tests.e2e.conftest import (
    BIDIR,
    V032,
    Stack,
    p_route_calls,
    pd_stack,
    pulled,
    reference_chat,
    streamed_turns,
)

BLOCK = 16  # the simulators' default block size


@pytest.fixture(scope="module")
def stock(redis_url_session: str) -> Iterator[Stack]:
    """Engines as stock vLLM 0.32 (no kv_transfer_params in streams), two D (a decode plan
    sent to the other one computes everything), a router with its default placement."""
    with start_stack(
        prefill=[(*BIDIR, *V032)],
        decode=[(*BIDIR, *V032), (*BIDIR, *V032)],
        reference=V032,
        redis=redis_url_session,
        name="placement",
    ) as st:
        yield st


def by_source(stack: Stack, source: str) -> float:
    """Prompt tokens of every D of the stack, by source."""
    name = "vllm:prompt_tokens_by_source_total"
    return sum(metric(d.url, name, source=source) for d in stack.ds)


def tokenize_calls(stack: Stack) -> float:
    """/tokenize requests the router's engines answered (the reference's are the test's)."""
    urls = [stack.p.url, *(d.url for d in stack.ds)]
    return sum(metric(u, "http_requests_total", handler="/tokenize") for u in urls)


def prompt_len(url: str, messages: list[Message]) -> int:
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    reply = post(url + "/tokenize", body)
    assert reply.status == 200, reply.body[:200]
    return len(reply.json()["tokens"])


def answer_tokens(url: str, messages: list[Message], max_tokens: int) -> int:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    reply = post(url + "/v1/chat/completions", body)
    assert reply.status == 200, reply.body[:200]
    return int(reply.json()["usage"]["completion_tokens"])


def test_a_streamed_chat_on_stock_engines_reuses_its_history_every_turn(stock: Stack) -> None:
    api = client(stock.router.base_url)
    cid = f"place-{uuid.uuid4().hex[:8]}"
    ref = stock.ref.url  # type: ignore[union-attr]
    messages: list[Message] = [{"role": "user", "content": "Stream the tide times for the bay."}]
    held = 0  # tokens of the conversation D computed (prompt + answer, the last one aside)
    for turn in range(1, 7):
        n_prompt = prompt_len(ref, messages)
        p_calls = sum(p_route_calls(stock.p.url))
        hit0, computed0 = by_source(stock, "local_cache_hit"), by_source(stock, "local_compute")
        pulled0 = by_source(stock, "external_kv_transfer")
        asked = tokenize_calls(stock)
        answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
        assert answer == reference_chat(stock, messages, 24), turn
        hit = by_source(stock, "local_cache_hit") - hit0
        computed = by_source(stock, "local_compute") - computed0
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit;via=decode", turn
            assert sum(p_route_calls(stock.p.url)) == p_calls, "no P leg"
            assert by_source(stock, "external_kv_transfer") == pulled0, "nothing moved"
            # Decided from the session's state: D's /tokenize is not asked (issue 49).
            assert tokenize_calls(stock) == asked, "no /tokenize"
            # D's prefix cache held every full block of what it computed last turn; it
            # computed only the rest: the new message and the template's tokens.
            cached = min(held, n_prompt - 1) // BLOCK * BLOCK
            assert (hit, computed) == (cached, n_prompt - cached), turn
            assert computed < BLOCK + prompt_len(ref, messages) - prompt_len(ref, messages[:-2])
        held = n_prompt + answer_tokens(ref, messages, 24) - 1
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And on day {turn}?"},
        ]


@pytest.fixture(scope="module")
def crowded(redis_url_session: str) -> Iterator[Stack]:
    """Slow decode steps (streams stay in flight), a D load limit of 2, two routers (the
    second's requests reach the first through D's own /metrics, read every 0.2 s)."""
    slow = (*BIDIR, *V032, "--decode-ms-per-token", "15")
    args = ("--decode-local-max-inflight", "2", "--health-interval", "0.2")
    with start_stack(
        prefill=[slow],
        decode=[slow],
        reference=("--decode-ms-per-token", "15"),
        routers=[args, args],
        redis=redis_url_session,
        name="crowded",
    ) as st:
        yield st


@pytest.mark.parametrize("via", [0, 1], ids=["this-router", "another-router"])
def test_the_decode_plan_backs_off_to_pd_while_d_is_crowded(crowded: Stack, via: int) -> None:
    api = client(crowded.router.base_url, timeout=60)
    cid = f"crowd-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Count the boats in the harbour."}]
    answer, _, _ = chat_turn(api, messages, stream=True, cid=cid)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    started = threading.Barrier(3)
    done: list[str] = []

    def long_stream(i: int) -> None:
        kwargs = {"model": MODEL, "max_tokens": 200, "stream": True}
        body = {"conversation_id": f"bg-{i}-{uuid.uuid4().hex[:6]}"}
        prompt = [{"role": "user", "content": f"A long story number {i}."}]
        with (
            client(crowded.routers[via].base_url, timeout=60) as other,
            other.chat.completions.with_streaming_response.create(
                messages=prompt,  # type: ignore[arg-type]
                extra_body=body,
                **kwargs,  # type: ignore[arg-type]
            ) as resp,
        ):
            chunks = resp.iter_lines()
            next(chunks)
            started.wait(10)
            for _ in chunks:
                pass
        done.append(str(i))

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(10)  # two streams in flight on the one D: at the limit
    time.sleep(0.6)  # a health read of D's /metrics since (for the other router's streams)
    p_calls = sum(p_route_calls(crowded.p.url))
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "miss;reason=stream-no-kv-params", "backed off to an ordinary P/D turn"
    assert sum(p_route_calls(crowded.p.url)) == p_calls + 1, "a P leg"
    assert answer == reference_chat(crowded, messages, 24)
    for t in threads:
        t.join(30)
    assert sorted(done) == ["0", "1"]
    time.sleep(0.6)  # a health read of D's /metrics since: idle again
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now?"}]
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "hit;via=decode", "D has room again"
    assert answer == reference_chat(crowded, messages, 24)


@pytest.fixture(scope="module")
def streams_params(redis_url_session: str) -> Iterator[Stack]:
    """A 0.32 D with PR #40186 (--stream-kv-params on the sim) and a router without the flag."""
    with pd_stack(redis_url_session, "learned", engines=V032, decode=["--stream-kv-params"]) as st:
        yield st


def test_a_d_that_streams_params_gives_a_hit_after_a_streamed_turn(streams_params: Stack) -> None:
    st = streams_params
    api = client(st.router.base_url)
    cid = f"learn-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Stream a recipe for bread."}]
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "miss;reason=no-session"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Rye?"}]
    before = pulled(st.p.url)
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "hit"
    assert pulled(st.p.url) > before, "P read D's blocks"
    assert answer == reference_chat(st, messages, 24)


@pytest.fixture(scope="module")
def streams_params_no_plan(redis_url_session: str) -> Iterator[Stack]:
    """The same, with the decode plan off: only what the router learned asks for token ids."""
    with pd_stack(
        redis_url_session,
        "learned-off",
        "--decode-local-max-tokens",
        "0",
        engines=V032,
        decode=["--stream-kv-params"],
    ) as st:
        yield st


def test_the_router_learns_that_d_streams_params(streams_params_no_plan: Stack) -> None:
    st = streams_params_no_plan
    cid = f"learn0-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Stream a recipe for soup."}]
    reuses = streamed_turns(st, messages, cid, ["0?", "1?"])
    # Turn 1 showed that D streams its handle, but was not asked for token ids yet.
    assert reuses == ["miss;reason=no-session", "miss;reason=no-token-ids", "hit"]
    (d,) = get_json(st.router.url + "/status")["instances"]["decode"]
    assert d["streams_params"] is True


def test_a_decode_plan_whose_d_fails_first_is_redone_as_pd_on_the_other_d(stock: Stack) -> None:
    api = client(stock.router.base_url)
    cid = f"fall-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Stream the ferry timetable."}]
    computed0 = [metric(d.url, "vllm:prompt_tokens_total") for d in stock.ds]
    answer, _, _ = chat_turn(api, messages, stream=True, cid=cid)
    moved = [
        metric(d.url, "vllm:prompt_tokens_total") - c
        for d, c in zip(stock.ds, computed0, strict=True)
    ]
    first, other = (stock.ds[0], stock.ds[1]) if moved[0] else (stock.ds[1], stock.ds[0])
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Late?"}]
    reply = post(first.url + "/sim/faults", {"fail_next": 1, "status": 503})
    assert reply.status == 200, reply.body
    p_calls = sum(p_route_calls(stock.p.url))
    other0 = metric(other.url, "vllm:prompt_tokens_total")
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "miss;reason=decode-local-failed"
    assert answer == reference_chat(stock, messages, 24)
    assert sum(p_route_calls(stock.p.url)) == p_calls + 1, "an ordinary P/D turn"
    assert metric(other.url, "vllm:prompt_tokens_total") > other0, "on the other D"
    # The other D now holds the conversation (it pulled the prompt from P and decoded).
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    hit0 = metric(other.url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "hit;via=decode"
    assert answer == reference_chat(stock, messages, 24)
    assert metric(other.url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") > hit0


def test_streamed_completions_and_id_less_chats_take_the_decode_plan(stock: Stack) -> None:
    api = client(stock.router.base_url)
    ref = client(stock.ref.url + "/v1")  # type: ignore[union-attr]
    cid = f"cmpl-{uuid.uuid4().hex[:8]}"
    prompt = f"Log {uuid.uuid4().hex[:6]}: the lighthouse keeper wrote that"
    for turn in range(1, 4):
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 24}
        with api.completions.with_streaming_response.create(
            stream=True,
            extra_body={"conversation_id": cid},
            **kwargs,  # type: ignore[arg-type]
        ) as resp:
            reuse = resp.headers["x-kv-reuse"]
            text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
        expected = ref.completions.create(**kwargs)  # type: ignore[call-overload]
        assert text == expected.choices[0].text, turn
        assert reuse == ("miss;reason=no-session" if turn == 1 else "hit;via=decode"), turn
        prompt += text + f" and on night {turn} he saw"
    # No conversation id: the session is found by the history, and runs on its D.
    messages: list[Message] = [{"role": "user", "content": f"Id-less {uuid.uuid4().hex[:6]}?"}]
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=None)
    assert reuse == "miss;reason=no-session"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=None)
    assert reuse == "hit;via=decode;id=history"
    assert answer == reference_chat(stock, messages, 24)
