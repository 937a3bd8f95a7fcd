"""A misconfigured router says so once, at start, with the fix (issue 51): a Redis that does
not answer (its URL, password masked, and the flag), a /v1 suffix on an engine URL, no engine
reachable; a request naming a model the engines do not serve gets a 404 naming theirs.
Real processes: `kvbaton serve`, simulator P/D, a Redis URL on a port nobody listens on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from harness.chat import JSON, get_json, post
from harness.metrics import metric
from harness.procs import SimProc, free_port, redis_server, sims, wait_until
from harness.router import RouterProc, router

PASSWORD = "hunter2-not-logged"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[SimProc]]:
    with sims(("prefill",), ("decode",), name="misconf") as pair:
        yield pair


def lines(r: RouterProc, text: str) -> list[str]:
    return [line for line in r.log.read_text().splitlines() if text in line]


@pytest.fixture(scope="module")
def misconfigured(engines: list[SimProc]) -> Iterator[RouterProc]:
    """P given with /v1, Redis on a port nobody listens on, the breaker retried every 0.1 s."""
    p, d = engines
    redis_url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    flags = ("--store-retry-after", "0.1", "--store-timeout", "0.2", "--health-interval", "0.1")
    with router([p.url + "/v1"], [d.url], *flags, redis_url=redis_url, name="misconf-router") as r:
        yield r


def test_a_redis_that_does_not_answer_is_said_once_with_the_flag(
    misconfigured: RouterProc,
) -> None:
    # Let the store fail many times over (turns, the pin sweep, the watch): still one line.
    wait_until(
        lambda: metric(misconfigured.url, "kvbaton_store_errors_total") >= 5,
        "several session-store failures",
    )
    said = lines(misconfigured, "does not answer")
    assert len(said) == 1, said
    (line,) = said
    assert "WARNING" in line and "Redis at redis://:***@127.0.0.1:" in line
    assert "--redis-url / KVBATON_REDIS_URL" in line and "routing without reuse" in line
    assert PASSWORD not in misconfigured.log.read_text()
    assert not lines(misconfigured, "still does not answer")  # a reminder: once a minute
    assert not lines(misconfigured, "session store failed")  # the old line every retry


def test_a_v1_suffix_gets_a_hint_at_start_and_in_the_failure(
    misconfigured: RouterProc, engines: list[SimProc]
) -> None:
    p = engines[0]
    hint = f"drop the /v1 suffix: the engine's base URL is {p.url}"
    at_start = lines(misconfigured, f"--prefill {p.url}/v1: {hint}")
    assert len(at_start) == 1, at_start
    failing = lines(misconfigured, "is not answering")
    assert len(failing) == 1 and hint in failing[0], failing


def test_start_up_lines_are_logged_once(misconfigured: RouterProc) -> None:
    found = lines(misconfigured, "model 'sim-model', block size")
    assert len(found) == 1, found


def test_an_unknown_model_is_a_404_naming_the_served_one(misconfigured: RouterProc) -> None:
    body = {"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}]}
    reply = post(misconfigured.url + "/v1/chat/completions", body)
    assert reply.status == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`Qwen/Qwen3-0.6B` does not exist" in error["message"]
    assert "`sim-model`" in error["message"]


def test_no_engine_reachable_says_so_not_an_empty_model() -> None:
    nowhere = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with router(nowhere[:1], nowhere[1:], name="misconf-nowhere") as r:
        said = lines(r, "no engine answered at start (1 prefill and 1 decode instances)")
        assert len(said) == 1, r.log.read_text()
        assert not lines(r, "model ''")


def test_a_redis_user_without_scripts_makes_ready_say_degraded(engines: list[SimProc]) -> None:
    """Issue 50, item 4: a Redis user whose ACL refuses EVALSHA once made every turn
    `store-unavailable` while /ready said the store was fine. Now the start says so once with
    the fix, /ready is degraded with the reason, and turns are served without reuse."""
    p, d = engines
    with redis_server() as (url, port, _):
        admin = redis.Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "&*", "+@all")
        admin.execute_command("ACL", "SETUSER", "noscripts", "-@scripting")
        admin.close()
        user_url = f"redis://noscripts:pw@127.0.0.1:{port}/0"
        with router([p.url], [d.url], redis_url=user_url, name="misconf-noscripts") as r:
            ready = get_json(r.url + "/ready")
            assert ready["degraded"] is True and ready["status"] == "ready", ready
            assert ready["store"].startswith("refused: ") and "permissions" in ready["store"], ready
            assert "+@scripting" in ready["store"]
            body = {"messages": [{"role": "user", "content": "hi"}], "conversation_id": "acl"}
            reply = post(r.url + "/v1/chat/completions", body)
            assert reply.status == 200, reply.body
            assert reply.headers["x-kv-reuse"] == "miss;reason=store-unavailable"
            said = lines(r, "refuses the router's commands")
    assert len(said) == 1 and "no permissions to run the 'evalsha'" in said[0], said


def test_the_documented_redis_acl_is_enough(engines: list[SimProc]) -> None:
    """docs/operations.md, The Redis user: a user with exactly those rights gets reuse."""
    p, d = engines
    with redis_server() as (url, port, _):
        admin = redis.Redis.from_url(url)
        rights = ["~kvbaton:*", "&*", "+@read", "+@write", "+@scripting", "+@connection", "+info"]
        admin.execute_command("ACL", "SETUSER", "kvbaton", "on", ">pw", *rights)
        admin.close()
        user_url = f"redis://kvbaton:pw@127.0.0.1:{port}/0"
        with router([p.url], [d.url], redis_url=user_url, name="misconf-acl") as r:
            assert get_json(r.url + "/ready")["store"] == "ok"
            messages = [{"role": "user", "content": "hi"}]
            first = post(
                r.url + "/v1/chat/completions",
                {"messages": messages},
                headers={**JSON, "X-Conversation-Id": "acl-ok"},
            )
            assert first.status == 200, first.body
            answer = first.json()["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "more"},
            ]
            second = post(
                r.url + "/v1/chat/completions",
                {"messages": messages},
                headers={**JSON, "X-Conversation-Id": "acl-ok"},
            )
            assert second.headers["x-kv-reuse"].startswith("hit"), second.headers
            assert not lines(r, "refuses"), "the documented rights were not enough"


def test_engines_that_come_up_after_the_router_are_learned_then() -> None:
    """The router starts before its engines (a deployment's usual race): when they answer,
    it learns the model and block size from them, says so in one line, and a turn that names
    no model gets theirs, with reuse from the second turn."""
    p_port, d_port = free_port(), free_port()
    urls = [f"http://127.0.0.1:{port}" for port in (p_port, d_port)]
    with router(urls[:1], urls[1:], "--health-interval", "0.2", name="misconf-late") as r:
        assert lines(r, "no engine answered at start"), r.log.read_text()
        assert get_json(r.url + "/status")["model"] == ""
        with sims(("prefill", "--port", str(p_port)), ("decode", "--port", str(d_port))):
            wait_until(lambda: bool(lines(r, "which answers now")), "the late engines learned")
            said = lines(r, "which answers now")
            assert len(said) == 1 and "model 'sim-model', block size 16" in said[0], said
            status = get_json(r.url + "/status")
            assert status["model"] == "sim-model" and status["block_size"] == 16, status
            wait_until(lambda: post(r.url + "/ready", None, method="GET").status == 200, "ready")
            headers = {**JSON, "X-Conversation-Id": "late"}
            messages = [{"role": "user", "content": "hello after the engines came up"}]
            first = post(r.url + "/v1/chat/completions", {"messages": messages}, headers=headers)
            assert first.status == 200, first.body
            assert first.json()["model"] == "sim-model"
            answer = first.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": answer}]
            messages += [{"role": "user", "content": "and then?"}]
            second = post(r.url + "/v1/chat/completions", {"messages": messages}, headers=headers)
            assert second.status == 200, second.body
            assert second.headers["x-kv-reuse"].startswith("hit"), second.headers
