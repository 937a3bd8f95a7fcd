"""Push mode end to end (`kvbaton serve --kv-connector nixl-push` on `kvbaton sim
--kv-connector nixl-push`): the OpenAI SDK holds 5-turn conversations whose every answer is the
from-scratch answer, P's write counters show the transfer of every turn, and the failure paths
of the concurrent legs end in a redone turn or one clear error, with nothing committed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from harness.chat import chat_turn, client, get_json, post, reference_answer
from harness.metrics import metric
from harness.procs import wait_until
from harness.stack import Stack, start_stack
from tests.e2e.helpers import D_PUSH, PUSH

SYSTEM = "You are a terse assistant about the weather and tea."


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    with start_stack(
        prefill=[PUSH],
        decode=[D_PUSH],
        reference=(),
        routers=[("--kv-connector", "nixl-push")],
        redis=redis_url_session,
        name="push",
    ) as st:
        yield st


def written(stack: Stack) -> float:
    return metric(stack.p.url, "vllm_sim:push_blocks_written_total")


def received(stack: Stack) -> float:
    return metric(stack.d.url, "vllm_sim:push_blocks_received_total")


def expect(turn: int) -> str:
    return "miss;reason=no-session" if turn == 1 else "miss;reason=push-affinity"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_chat_answers_as_from_scratch(stack: Stack, stream: bool) -> None:
    with client(stack.router.base_url) as api:
        cid = f"push-{uuid.uuid4().hex[:8]}"
        messages: list[dict[str, str]] = [{"role": "system", "content": f"{SYSTEM} {stream}"}]
        for turn in range(1, 6):
            messages.append({"role": "user", "content": f"Question {turn}: will it rain?"})
            before_w, before_r = written(stack), received(stack)
            answer, reuse, _ = chat_turn(api, messages, stream=stream, cid=cid)
            assert answer == reference_answer(stack.ref.url, messages, 24), f"turn {turn}"
            assert reuse == expect(turn), f"turn {turn}"
            # P wrote D the blocks D lacked (D's own prefix cache holds the earlier turns).
            assert written(stack) > before_w, f"turn {turn}: P wrote nothing"
            assert received(stack) - before_r == written(stack) - before_w
            messages.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_completions(stack: Stack, stream: bool) -> None:
    with client(stack.router.base_url) as api, client(stack.ref.url + "/v1") as ref:
        cid = f"pcmpl-{uuid.uuid4().hex[:8]}"
        prompt = "The weather report for the coming week says"
        for turn in range(1, 6):
            kwargs: dict[str, Any] = {
                "model": "sim-model",
                "prompt": prompt,
                "max_tokens": 24,
                "extra_body": {"conversation_id": cid},
            }
            before = written(stack)
            if stream:
                with api.completions.with_streaming_response.create(stream=True, **kwargs) as resp:
                    reuse = resp.headers["x-kv-reuse"]
                    text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
            else:
                raw = api.completions.with_raw_response.create(**kwargs)
                reuse, text = raw.headers["x-kv-reuse"], raw.parse().choices[0].text
            expected = ref.completions.create(model="sim-model", prompt=prompt, max_tokens=24)
            assert text == expected.choices[0].text, f"turn {turn}"
            assert reuse == expect(turn), f"turn {turn}"
            assert written(stack) > before
            prompt = prompt + text + f" and then on day {turn} it"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_responses(stack: Stack, stream: bool) -> None:
    with client(stack.router.base_url) as api, client(stack.ref.url + "/v1") as ref:
        cid = f"presp-{uuid.uuid4().hex[:8]}"
        items: list[dict[str, Any]] = []
        for turn in range(1, 6):
            items.append({"role": "user", "content": f"Turn {turn}: wind speed?"})
            kwargs: dict[str, Any] = {
                "model": "sim-model",
                "input": items,
                "max_output_tokens": 24,
                "extra_body": {"conversation_id": cid},
            }
            before = written(stack)
            if stream:
                with api.responses.with_streaming_response.create(stream=True, **kwargs) as r:
                    reuse = r.headers["x-kv-reuse"]
                    text = "".join(
                        e.delta for e in r.parse() if e.type == "response.output_text.delta"
                    )
            else:
                raw = api.responses.with_raw_response.create(**kwargs)
                reuse, text = raw.headers["x-kv-reuse"], raw.parse().output_text
            kwargs.pop("extra_body")
            assert text == ref.responses.create(**kwargs).output_text, f"turn {turn}"
            assert reuse == expect(turn), f"turn {turn}"
            assert written(stack) > before
            items.append({"role": "assistant", "content": text})


def test_status_shows_modes_and_learned_coordinates(stack: Stack) -> None:
    status = get_json(stack.router.url + "/status")
    (p,) = status["instances"]["prefill"]
    (d,) = status["instances"]["decode"]
    assert d["kv"] == {"mode": "nixl-push"}
    assert p["kv"]["usable"] is True
    coords = p["kv"]["coordinates"]
    assert coords["engine_id"] == stack.p.engine_id
    assert coords["port"] == stack.p.kv_port
    assert coords["transfer_mode"] == "push"
    assert coords["source"] in ("probe", "response")


def fault(url: str, **body: Any) -> None:
    assert post(url + "/sim/faults", body).status == 200


def test_p_failing_while_d_waits_is_redone(stack: Stack) -> None:
    with client(stack.router.base_url) as api:
        messages = [{"role": "user", "content": "P fails once: is it foggy?"}]
        fault(stack.p.url, fail_next=1, status=500)
        before = written(stack)
        answer, reuse, _ = chat_turn(api, messages, cid=f"pf-{uuid.uuid4().hex[:8]}")
        assert answer == reference_answer(stack.ref.url, messages, 24)
        assert reuse == "miss;reason=no-session"
        assert written(stack) > before  # the redone dispatch (a new transfer id) wrote


def test_d_failing_while_p_holds_blocks_is_redone(stack: Stack) -> None:
    with client(stack.router.base_url) as api:
        messages = [{"role": "user", "content": "D fails once: is it windy?"}]
        fault(stack.d.url, fail_next=1, status=500)
        answer, _, _ = chat_turn(api, messages, cid=f"df-{uuid.uuid4().hex[:8]}")
        assert answer == reference_answer(stack.ref.url, messages, 24)
        # The first dispatch's P leg got no registration; the router gave it up (closed its
        # connection), so P aborts it and frees its blocks at once, as vLLM does for a client
        # that left, instead of waiting out the lease for a D that will never register.
        wait_until(
            lambda: metric(stack.p.url, "vllm:num_requests_running") == 0,
            "P to drop the abandoned transfer",
            timeout=10,
        )


def test_turn_failing_twice_is_one_error_and_commits_nothing(stack: Stack) -> None:
    cid = f"ff-{uuid.uuid4().hex[:8]}"
    fault(stack.d.url, fail_next=2, status=500)
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Both tries fail."}],
        "max_tokens": 8,
        "conversation_id": cid,
    }
    reply = post(stack.router.base_url + "/chat/completions", body)
    assert reply.status == 502, reply.body
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert reply.headers["x-request-id"]
    r = redis.Redis.from_url(stack.redis_url or "", decode_responses=True)
    keys = r.keys(f"kvbaton:conv:{{*:{cid}}}")
    assert all(r.hget(k, "turn") in (None, "0") for k in keys), keys  # no turn committed
    r.close()
    with client(stack.router.base_url) as api:
        _, reuse, _ = chat_turn(api, body["messages"], cid=cid)
    assert reuse == "miss;reason=no-session"


def test_client_leaving_commits_nothing(stack: Stack) -> None:
    cid = f"gone-{uuid.uuid4().hex[:8]}"
    fault(stack.p.url, stall_next=1, stall_s=2.0)
    messages = [{"role": "user", "content": "I will not wait for this."}]
    with client(stack.router.base_url, timeout=0.5) as api, pytest.raises(openai.APITimeoutError):
        chat_turn(api, messages, cid=cid)
    time.sleep(2.5)
    with client(stack.router.base_url) as api:
        _, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "miss;reason=no-session"  # the abandoned turn committed nothing


def test_a_busy_p_429_is_relayed_when_no_other_p_is_free(stack: Stack) -> None:
    fault(stack.p.url, fail_next=1, status=429)
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "Busy?"}]}
    reply = post(stack.router.base_url + "/chat/completions", body)
    assert reply.status == 429, reply.body
    assert reply.headers["x-request-id"]
    assert get_json(stack.router.url + "/status")["instances"]["prefill"][0]["failures"] == 0
