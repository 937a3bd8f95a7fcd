"""vllm#51919's handover through the router: D's request sent beside P's and released by
/v1/pd_kv_ready, P's token 1 seeded on D, learned per engine; answers equal a from-scratch
engine's, later turns still read from D, and every failure leaves nothing parked or pinned."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from harness.chat import chat_turn, client, get_json, post, reference_answer
from harness.metrics import metric
from harness.procs import wait_until
from harness.stack import Stack, start_stack
from tests.e2e.conftest import BIDIR

PARK_TIMEOUT = "2"
OFF = ("--no-concurrent-dispatch", "--no-first-token-seeding")


@pytest.fixture(scope="module")
def st(redis_url_session: str) -> Iterator[Stack]:
    """P seeds, D seeds and parks; router 0 uses both, router 1 has them turned off."""
    with start_stack(
        prefill=[(*BIDIR, "--seed-first-token")],
        decode=[(*BIDIR, "--seed-first-token", "--pd-kv-ready", "--pd-park-timeout", PARK_TIMEOUT)],
        reference=(),
        routers=[(), OFF],
        redis=redis_url_session,
        name="handover",
    ) as stack:
        for url in stack.router_urls:
            wait_until(lambda u=url: _learned(u) is True, "D's /v1/pd_kv_ready learned")
        yield stack


def _learned(router_url: str) -> Any:
    return get_json(router_url + "/status")["instances"]["decode"][0]["vllm"]["pd_kv_ready"]


def _state(url: str) -> dict[str, Any]:
    state: dict[str, Any] = get_json(url + "/sim/state")
    return state


def _pins(url: str) -> set[str]:
    return {p["request_id"] for p in _state(url)["pins"]}


def _conversation(st: Stack, router_url: str, turns: int, *, stream: bool) -> list[str]:
    """`turns` turns of one conversation; every answer equals the reference's. X-KV-Reuse."""
    cid = uuid.uuid4().hex
    messages: list[dict[str, str]] = [{"role": "user", "content": f"tell me {cid} " * 20}]
    reuses = []
    for i in range(turns):
        with client(router_url + "/v1") as api:
            answer, reuse, _ = chat_turn(api, messages, cid=cid, stream=stream)  # type: ignore[arg-type]
        assert answer == reference_answer(st.ref.url, messages, 24)  # type: ignore[arg-type]
        reuses.append(reuse)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"and then {i} " * 12},
        ]
    return reuses


def _handovers(router_url: str, mode: str) -> float:
    return metric(router_url, "kvbaton_handover_seconds_count", mode=mode)


@pytest.mark.parametrize("stream", [False, True])
def test_both_features_give_the_same_answers_and_later_turns_hit(st: Stack, stream: bool) -> None:
    d = st.d.url
    seeded = metric(d, "vllm_sim:seeded_first_tokens_total")
    parked = metric(d, "vllm_sim:parked_requests_total")
    before = _handovers(st.url, "concurrent-seeded")
    reuses = _conversation(st, st.url, 3, stream=stream)
    assert all(r.startswith("hit") for r in reuses[1:]), reuses
    assert _handovers(st.url, "concurrent-seeded") == before + 3
    assert metric(d, "vllm_sim:seeded_first_tokens_total") == seeded + 3
    assert metric(d, "vllm_sim:parked_requests_total") == parked + 3
    assert metric(d, "vllm_sim:seed_mismatches_total") == 0
    assert metric(d, "vllm_sim:park_timeouts_total") == 0


def test_turned_off_the_turn_is_sequential_and_the_same(st: Stack) -> None:
    url = st.router_urls[1]
    seeded = metric(st.d.url, "vllm_sim:seeded_first_tokens_total")
    parked = metric(st.d.url, "vllm_sim:parked_requests_total")
    before = _handovers(url, "sequential")
    reuses = _conversation(st, url, 2, stream=True)
    assert reuses[1].startswith("hit"), reuses
    assert _handovers(url, "sequential") == before + 2
    assert metric(st.d.url, "vllm_sim:seeded_first_tokens_total") == seeded
    assert metric(st.d.url, "vllm_sim:parked_requests_total") == parked


def test_a_lost_ready_notification_is_survived_by_the_park_timeout(st: Stack) -> None:
    d = st.d.url
    timeouts = metric(d, "vllm_sim:park_timeouts_total")
    post(d + "/sim/faults", {"drop_ready_next": 1}, timeout=5)
    reuses = _conversation(st, st.url, 2, stream=False)  # turn 1 prefills locally on D
    assert reuses[1].startswith("hit"), reuses  # D's handle of turn 1 was kept
    assert metric(d, "vllm_sim:park_timeouts_total") == timeouts + 1


def test_a_p_failing_after_d_was_dispatched_leaves_nothing(st: Stack) -> None:
    p, d = st.p.url, st.d.url
    p_pins, d_pins = _pins(p), _pins(d)
    parked = metric(d, "vllm_sim:parked_requests_total")
    fell_back = metric(st.url, "kvbaton_handover_fallbacks_total", reason="prefill-failed")
    post(p + "/sim/faults", {"stall_s": 1.0, "fail_next": 1, "status": 500}, timeout=5)
    failed: list[BaseException] = []

    def turn() -> None:
        try:
            with client(st.url + "/v1") as api:
                chat_turn(api, [{"role": "user", "content": "hi"}], cid=None)
        except openai.APIStatusError as exc:
            failed.append(exc)

    worker = threading.Thread(target=turn)
    worker.start()
    # D got its request and parked it while P was still computing.
    wait_until(lambda: metric(d, "vllm_sim:parked_requests_total") > parked, "D parked", 10)
    worker.join(30)
    assert failed and isinstance(failed[0], openai.InternalServerError | openai.APIStatusError)
    wait_until(lambda: not _state(d)["parked"], "D's parked request aborted", 10)
    assert _pins(p) == p_pins and _pins(d) == d_pins
    fallbacks = metric(st.url, "kvbaton_handover_fallbacks_total", reason="prefill-failed")
    assert fallbacks == fell_back + 1


@pytest.fixture(scope="module")
def plain(redis_url_session: str) -> Iterator[Stack]:
    """Engines without vllm#51919, as vLLM 0.32 and 0.33 are."""
    with start_stack(
        prefill=[BIDIR],
        decode=[BIDIR],
        reference=(),
        routers=[()],
        redis=redis_url_session,
        name="nohandover",
    ) as stack:
        wait_until(lambda: _learned(stack.url) is False, "D's missing route learned")
        yield stack


def test_engines_without_the_features_are_served_as_before(plain: Stack) -> None:
    before = _handovers(plain.url, "sequential")
    reuses = _conversation(plain, plain.url, 2, stream=True)
    assert reuses[1].startswith("hit"), reuses
    assert _handovers(plain.url, "sequential") == before + 2
    for mode in ("concurrent", "concurrent-seeded", "seeded"):
        assert _handovers(plain.url, mode) == 0
    assert "first_token_ids" not in str(_state(plain.d.url)["pins"])


def test_a_client_leaving_while_d_is_parked_leaves_nothing(st: Stack) -> None:
    p, d = st.p.url, st.d.url
    p_pins, d_pins = _pins(p), _pins(d)
    parked = metric(d, "vllm_sim:parked_requests_total")
    post(p + "/sim/faults", {"stall_s": 1.5, "stall_next": 1}, timeout=5)
    with client(st.url + "/v1", timeout=0.8) as api, pytest.raises(openai.APITimeoutError):
        chat_turn(api, [{"role": "user", "content": "bye"}], cid=None)
    assert metric(d, "vllm_sim:parked_requests_total") == parked + 1
    wait_until(lambda: not _state(d)["parked"], "D's parked request aborted", 10)
    wait_until(lambda: _state(p)["running"] == 0, "P's request cancelled", 10)
    assert _pins(p) == p_pins and _pins(d) == d_pins
