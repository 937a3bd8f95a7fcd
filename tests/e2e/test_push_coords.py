"""Push mode's P coordinates on real processes: learned by the start-up probe, a pull-mode P
left out with its reason in /status, given by the seeds' add, and wrong ones from
--prefill-coordinates failing the turn with one clear error and nothing committed."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from harness.chat import chat_turn, client, get_json, post, reference_answer
from harness.metrics import metric
from harness.procs import sim
from harness.router import router
from harness.stack import Stack, start_stack
from tests.e2e.helpers import D_PUSH, PUSH

KEY = "push-seed-admin-key"


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    with start_stack(
        prefill=[PUSH, ()],  # P0 pushes; P1 runs the pull connector
        decode=[D_PUSH],
        reference=(),
        routers=[("--kv-connector", "nixl-push", "--admin-api-key", KEY)],
        # Its own database: the seeds test's instance stays in this one's registry.
        redis=redis_url_session.rsplit("/", 1)[0] + "/3",
        name="pushc",
    ) as st:
        yield st


def prefills(url: str) -> dict[str, dict[str, Any]]:
    return {p["url"]: p for p in get_json(url + "/status")["instances"]["prefill"]}


def test_probe_learns_push_p_and_leaves_out_pull_p(stack: Stack) -> None:
    p0, p1 = stack.ps
    seen = prefills(stack.router.url)
    assert seen[p0.url]["kv"]["coordinates"]["engine_id"] == p0.engine_id
    assert seen[p0.url]["kv"]["coordinates"]["source"] in ("probe", "response")
    assert seen[p1.url]["kv"]["usable"] is False
    assert "pull" in seen[p1.url]["kv"]["reason"]
    with client(stack.router.base_url) as api:
        chats = metric(p1.url, "http_requests_total", handler="/v1/chat/completions", status="2xx")
        messages = [{"role": "user", "content": "Only the push P serves: any hail?"}]
        cid = f"pc-{uuid.uuid4().hex[:8]}"
        for turn in range(3):
            answer, _, _ = chat_turn(api, messages, cid=cid)
            assert answer == reference_answer(stack.ref.url, messages, 24), f"turn {turn}"
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And?"},
            ]
        assert (
            metric(p1.url, "http_requests_total", handler="/v1/chat/completions", status="2xx")
            == chats
        )


def test_seeds_add_takes_coordinates(stack: Stack) -> None:
    with sim("prefill", *PUSH, name="pushc-p2") as p2:
        body = {
            "type": "prefill",
            "instance": p2.url,
            "engine_id": p2.engine_id,
            "side_channel_host": "127.0.0.1",
            "side_channel_port": p2.kv_port,
        }
        req = urllib.request.Request(
            stack.router.url + "/instances/add",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "X-API-Key": KEY},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=20) as resp:
            assert resp.status == 201
            added = json.loads(resp.read())["instance"]
        assert added["kv"]["coordinates"]["source"] == "admin"
        assert added["kv"]["coordinates"]["port"] == p2.kv_port
        half = {k: v for k, v in body.items() if k != "side_channel_port"}
        reply = post(stack.router.url + "/instances/add", half, headers={"X-API-Key": KEY})
        assert reply.status == 400, reply.body


def test_wrong_configured_coordinates_fail_and_commit_nothing(stack: Stack) -> None:
    p0 = stack.ps[0]
    wrong = f"{p0.url}=not-{p0.engine_id}@127.0.0.1:{p0.kv_port}"
    args = ("--kv-connector", "nixl-push", "--prefill-coordinates", wrong)
    db = (stack.redis_url or "").rsplit("/", 1)[0] + "/5"  # not the seeds test's registry
    with router([p0.url], [stack.d.url], *args, redis_url=db, name="pushc-wrong") as r:
        (p,) = get_json(r.url + "/status")["instances"]["prefill"]
        assert p["kv"]["coordinates"]["source"] == "config"
        cid = f"wrong-{uuid.uuid4().hex[:8]}"
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "Wrong coordinates."}],
            "max_tokens": 8,
            "conversation_id": cid,
        }
        reply = post(r.base_url + "/chat/completions", body)
        assert reply.status == 502, reply.body
        assert set(reply.json()["error"]) >= {"message", "type", "code"}
        assert reply.headers["x-request-id"]
        store = redis.Redis.from_url(db, decode_responses=True)
        keys = store.keys(f"kvbaton:conv:{{*:{cid}}}")
        assert all(store.hget(k, "turn") in (None, "0") for k in keys), keys
        store.close()


def test_no_p_with_coordinates_is_a_503(stack: Stack) -> None:
    p1 = stack.ps[1]  # the pull-mode P alone: never used in push mode
    args = ("--kv-connector", "nixl-push")
    with router([p1.url], [stack.d.url], *args, redis_url=None, name="pushc-none") as r:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}
        reply = post(r.base_url + "/chat/completions", body)
        assert reply.status == 503, reply.body
        assert "push coordinates" in reply.json()["error"]["message"]
        assert reply.headers["x-request-id"]
