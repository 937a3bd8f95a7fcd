"""MoRI-IO end to end (`kvbaton serve --kv-connector moriio --moriio-register ...` on `kvbaton
sim --kv-connector moriio`): the instances announce themselves over ZMQ and join the pool,
the OpenAI SDK holds 5-turn conversations in READ and in WRITE mode whose every answer is the
from-scratch answer, the simulators' counters show each turn's transfer on the P rank the
router pinned, the request id names both announced addresses, a wrong rank and a wrong
address each fail, and an instance that stops announcing is dropped."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from harness.chat import client, get_json, post, reference_answer
from harness.metrics import metric
from harness.procs import SimProc, free_port, log_file, sim, wait_until
from harness.router import SESSION_SECRET, RouterProc, http_process

SYSTEM = "You are a terse assistant about rivers and bridges."
TTL = 2.0


def sim_flags(reg: int, mode: str) -> tuple[str, ...]:
    return (
        "--kv-connector", "moriio", "--moriio-mode", mode,
        "--moriio-proxy", f"127.0.0.1:{reg}", "--moriio-ping-interval", "0.2",
        "--kv-lease-duration", "3", "--push-registration-timeout", "3", "--log-requests",
    )  # fmt: skip


@dataclass
class Mori:
    router: RouterProc
    p: SimProc
    d: SimProc
    ref: SimProc
    reg: int
    mode: str


def announced(r: RouterProc) -> dict[str, dict[str, Any]]:
    return {a["url"]: a for a in get_json(r.url + "/status")["moriio"]["announced"]}


@contextlib.contextmanager
def mori_stack(redis_url: str, mode: str) -> Iterator[Mori]:
    reg = free_port()

    def argv(port: int) -> list[str]:
        return [
            "router", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--redis-url", redis_url, "--session-secret", SESSION_SECRET,
            "--kv-connector", "moriio", "--model", "sim-model",
            "--moriio-register", f"tcp://127.0.0.1:{reg}",
            "--moriio-register-ttl", str(TTL), "--health-interval", "1",
        ]  # fmt: skip

    flags = sim_flags(reg, mode)
    kv = ("--kv-port", str(free_port(span=2)))  # a two-rank P listens on PORT and PORT + 1
    with (
        http_process(argv, f"moriio-{mode}-router", stop_timeout=15) as r,
        sim("prefill", *flags, "--data-parallel-size", "2", *kv, name=f"mori-{mode}-p") as p,
        sim("decode", *flags, name=f"mori-{mode}-d") as d,
        sim("decode", name=f"mori-{mode}-ref") as ref,
    ):
        wait_until(lambda: len(get_json(r.url + "/status")["decode_nodes"]) == 1, "D joins")
        wait_until(lambda: len(get_json(r.url + "/status")["prefill_nodes"]) == 1, "P joins")
        yield Mori(r, p, d, ref, reg, mode)


@pytest.fixture(scope="module", params=["READ", "WRITE"])
def mori(request: pytest.FixtureRequest, redis_url_session: str) -> Iterator[Mori]:
    with mori_stack(redis_url_session, request.param) as m:
        yield m


def rank_reads(m: Mori) -> list[int]:
    return [int(r["reads_served"]) for r in get_json(m.p.url + "/sim/state")["ranks"]]


def rank_prompts(m: Mori) -> list[int]:
    return [int(r["prompt_tokens"]) for r in get_json(m.p.url + "/sim/state")["ranks"]]


def moved(m: Mori) -> float:
    """Blocks moved P -> D: read by D (READ) or written by P (WRITE)."""
    if m.mode == "READ":
        return metric(m.d.url, "vllm:nixl_xfer_time_seconds_count")
    return metric(m.p.url, "vllm_sim:push_blocks_written_total")


def last_request_id(m: Mori, inst: SimProc) -> str:
    """The X-Request-Id of the last OpenAI request the instance logged (--log-requests)."""
    name = f"mori-{m.mode}-{'p' if inst is m.p else 'd'}-{inst.port}"
    lines = [ln for ln in log_file(name).read_text().splitlines() if "Received request" in ln]
    return lines[-1].split("Received request ", 1)[1].split(" on ", 1)[0]


def chat(m: Mori, messages: list[dict[str, str]], cid: str, stream: bool) -> tuple[str, str, str]:
    """(answer, the X-Request-Id and the X-KV-Reuse the router answered)."""
    with client(m.router.base_url) as api:
        kwargs: dict[str, Any] = {"model": "sim-model", "messages": messages, "max_tokens": 24}
        kwargs["extra_body"] = {"conversation_id": cid}
        if stream:
            with api.chat.completions.with_streaming_response.create(stream=True, **kwargs) as r:
                rid, reuse = r.headers["x-request-id"], r.headers["x-kv-reuse"]
                text = "".join(c.choices[0].delta.content or "" for c in r.parse() if c.choices)
            return text, rid, reuse
        raw = api.chat.completions.with_raw_response.create(**kwargs)
        text = raw.parse().choices[0].message.content or ""
        return text, raw.headers["x-request-id"], raw.headers["x-kv-reuse"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turns_answer_as_from_scratch_with_the_transfer_on_the_pinned_rank(
    mori: Mori, stream: bool
) -> None:
    peers = announced(mori.router)
    p_zmq, d_zmq = peers[mori.p.url]["zmq_address"], peers[mori.d.url]["zmq_address"]
    assert p_zmq == f"host:127.0.0.1,handshake:{mori.p.kv_port},notify:{mori.p.kv_port}"
    assert get_json(mori.router.url + "/status")["moriio"]["mode"] == mori.mode
    cid = f"mori-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, str]] = [{"role": "system", "content": f"{SYSTEM} {stream}"}]
    ranks_used: set[int] = set()
    for turn in range(1, 6):
        messages.append({"role": "user", "content": f"Question {turn}: how long is the river?"})
        before_moved, before_reads, before_prompts = (
            moved(mori),
            rank_reads(mori),
            rank_prompts(mori),
        )
        answer, rid, reuse = chat(mori, messages, cid, stream)
        assert reuse == ("miss;reason=no-session" if turn == 1 else "miss;reason=push-affinity")
        assert answer == reference_answer(mori.ref.url, messages, 24), f"turn {turn}"
        assert rid and not rid.startswith("___"), rid  # the client keeps its turn's id
        legs = {last_request_id(mori, mori.p), last_request_id(mori, mori.d)}
        (leg_id,) = legs  # one id for both legs, naming both announced addresses
        assert re.fullmatch(
            rf"___prefill_addr_{re.escape(p_zmq)}___decode_addr_{re.escape(d_zmq)}_[0-9a-f]{{32}}",
            leg_id,
        )
        assert moved(mori) > before_moved, f"turn {turn}: no KV moved P -> D"
        prompts = [a - b for a, b in zip(rank_prompts(mori), before_prompts, strict=True)]
        (rank,) = [i for i, n in enumerate(prompts) if n]  # P's leg ran on one rank
        ranks_used.add(rank)
        if mori.mode == "READ":  # D read from that rank's side channel, no other
            reads = [a - b for a, b in zip(rank_reads(mori), before_reads, strict=True)]
            assert reads[rank] > 0 and reads[1 - rank] == 0, (turn, reads)
        messages.append({"role": "assistant", "content": answer})
    assert len(ranks_used) == 1, f"P legs ran on ranks {ranks_used}: no rank affinity"


def _by_hand(m: Mori, p_rank: int, told_rank: int, prefill_zmq: str) -> int:
    """One turn wired by hand like the router, except what the arguments change: D's status."""
    peers = announced(m.router)
    d_zmq = peers[m.d.url]["zmq_address"]
    rid = f"___prefill_addr_{prefill_zmq}___decode_addr_{d_zmq}_{uuid.uuid4().hex}"
    transfer_id = f"tx-{uuid.uuid4()}"
    body = {
        "model": "sim-model",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "wrong " + rid[-6:]}],
    }
    p_body = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id,
            "remote_dp_size": 1,
            "remote_tp_size": 1,
        },
    }
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    d_kv: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_dp_size": 2,
        "remote_tp_size": 1,
        "remote_dp_rank": told_rank,
    }
    p_headers = {**headers, "X-data-parallel-rank": str(p_rank)}
    if m.mode == "READ":
        p_reply = post(m.p.url + "/v1/chat/completions", p_body, headers=p_headers)
        assert p_reply.status == 200
        kv = json.loads(p_reply.body)["kv_transfer_params"]
        d_kv.update(
            remote_engine_id=kv["remote_engine_id"], remote_block_ids=kv["remote_block_ids"]
        )
        return post(
            m.d.url + "/v1/chat/completions", {**body, "kv_transfer_params": d_kv}, headers=headers
        ).status
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p_fut = pool.submit(post, m.p.url + "/v1/chat/completions", p_body, headers=p_headers)
        d_fut = pool.submit(
            post,
            m.d.url + "/v1/chat/completions",
            {**body, "kv_transfer_params": d_kv},
            headers=headers,
        )
        p_fut.result()
        return d_fut.result().status


def test_wiring_by_hand_right_rank_succeeds_wrong_rank_and_address_fail(mori: Mori) -> None:
    peers = announced(mori.router)
    p_zmq, d_zmq = peers[mori.p.url]["zmq_address"], peers[mori.d.url]["zmq_address"]
    assert _by_hand(mori, 1, 1, p_zmq) == 200  # the control: this wiring works
    assert _by_hand(mori, 0, 1, p_zmq) >= 400  # D told rank 1, P's leg ran on rank 0
    assert _by_hand(mori, 1, 1, d_zmq) >= 400  # the id names D's address as P's


def test_an_announced_instance_joins_and_one_that_stops_is_dropped(mori: Mori) -> None:
    with sim("decode", *sim_flags(mori.reg, mori.mode), name=f"mori-{mori.mode}-d2") as d2:
        wait_until(
            lambda: d2.url in get_json(mori.router.url + "/status")["decode_nodes"], "D2 joins"
        )
        assert announced(mori.router)[d2.url]["role"] == "decode"
    # Stopped: no more announcements; dropped after the ttl (and the turn keeps working).
    wait_until(
        lambda: d2.url not in get_json(mori.router.url + "/status")["decode_nodes"],
        "D2 dropped",
        timeout=TTL * 5,
    )
    assert d2.url not in announced(mori.router)


def test_an_announcement_with_another_mode_is_refused(mori: Mori) -> None:
    other = "WRITE" if mori.mode == "READ" else "READ"
    with sim("decode", *sim_flags(mori.reg, other), name=f"mori-{mori.mode}-odd") as odd:
        time.sleep(1.0)
        assert odd.url not in get_json(mori.router.url + "/status")["decode_nodes"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_completions_and_responses(mori: Mori, stream: bool) -> None:
    with client(mori.router.base_url) as api, client(mori.ref.url + "/v1") as ref:
        cid = f"mcmpl-{uuid.uuid4().hex[:8]}"
        prompt = "The river report for the coming week says"
        items: list[dict[str, Any]] = []
        for turn in range(1, 6):
            kwargs: dict[str, Any] = {"model": "sim-model", "prompt": prompt, "max_tokens": 16}
            before = moved(mori)
            if stream:
                with api.completions.with_streaming_response.create(
                    stream=True, extra_body={"conversation_id": cid}, **kwargs
                ) as resp:
                    text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
            else:
                text = api.completions.create(extra_body={"conversation_id": cid}, **kwargs)
                text = text.choices[0].text
            assert text == ref.completions.create(**kwargs).choices[0].text, f"turn {turn}"
            assert moved(mori) > before, f"completions turn {turn}: no KV moved"
            prompt = prompt + text + f" and on day {turn} it"
            items.append({"role": "user", "content": f"Turn {turn}: water level?"})
            rkw: dict[str, Any] = {"model": "sim-model", "input": items, "max_output_tokens": 16}
            before = moved(mori)
            answer = api.responses.create(extra_body={"conversation_id": cid + "r"}, **rkw)
            assert answer.output_text == ref.responses.create(**rkw).output_text, f"turn {turn}"
            assert moved(mori) > before, f"responses turn {turn}: no KV moved"
            items.append({"role": "assistant", "content": answer.output_text})


@pytest.mark.parametrize("leg", ["p", "d"])
def test_a_failed_leg_is_one_error_and_commits_nothing(mori: Mori, leg: str) -> None:
    cid = f"mfail-{leg}-{uuid.uuid4().hex[:8]}"
    inst = mori.p if leg == "p" else mori.d
    assert post(inst.url + "/sim/faults", {"fail_next": 1, "status": 500}).status == 200
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"This {leg} leg fails."}],
        "max_tokens": 8,
        "conversation_id": cid,
    }
    reply = post(mori.router.base_url + "/chat/completions", body)
    assert reply.status == 502, reply.body
    assert set(reply.json()["error"]) >= {"message", "type", "code"}
    assert reply.headers["x-request-id"]
    with client(mori.router.base_url) as api:  # nothing was committed: a new conversation
        raw = api.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=[{"role": "user", "content": f"This {leg} leg fails."}],
            max_tokens=8,
            extra_body={"conversation_id": cid},
        )
    assert raw.headers["x-kv-reuse"] == "miss;reason=no-session"
