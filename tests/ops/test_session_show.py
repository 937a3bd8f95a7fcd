"""`kvbaton session show ID --api-key KEY`: an operator finds a conversation's key, tenant, log
name and state from what they know. Real processes: a private redis-server, simulator P and D,
`kvbaton serve` signing its sessions, turns through the OpenAI SDK, the command as run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from harness.chat import chat_turn, client
from harness.router import SESSION_SECRET
from harness.stack import Stack, start_stack

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")
API_KEY = "sk-operator-knows-this"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with start_stack(prefill=[BIDIR], decode=[BIDIR], name="show") as st:
        api = client(st.router.base_url, api_key=API_KEY)
        messages = [{"role": "user", "content": "Plan a day in Lisbon."}]
        first = chat_turn(api, messages, cid="chat-42")
        messages += [{"role": "assistant", "content": first.text}]
        messages += [{"role": "user", "content": "And the evening?"}]
        assert chat_turn(api, messages, cid="chat-42").reuse == "hit"
        api.close()
        yield st


def show(st: Stack, *args: str, secret: str | None = SESSION_SECRET) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_")}
    if secret is not None:
        env["KVBATON_SESSION_SECRET"] = secret
    argv = [sys.executable, "-m", "router", "session", "show", *args]
    argv += ["--redis-url", str(st.redis_url)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    return done.returncode, done.stdout + done.stderr


def stored_key(st: Stack) -> str:
    """The conversation's key as Redis has it, found without the router's hashing."""
    client = redis.Redis.from_url(str(st.redis_url), decode_responses=True)
    try:
        (key,) = client.scan_iter(match="kvbaton:conv:{*:chat-42}")
    finally:
        client.close()
    return str(key)


def test_show_finds_the_key_the_log_name_and_a_verified_state(stack: Stack) -> None:
    status, out = show(stack, "chat-42", "--api-key", API_KEY)
    assert status == 0, out
    key = stored_key(stack)
    assert f"key        {key}\n" in out
    tenant = key.split("{")[1].split(":")[0]
    assert re.fullmatch(r"[0-9a-f]{16}", tenant) and f"tenant     {tenant}  " in out
    log_name = re.search(r"log name   conv=(\w+)", out)
    assert log_name is not None, out
    turns = [line for line in stack.router.log.read_text().splitlines() if " turn " in line]
    ours = [line for line in turns if f"conv={log_name[1]} " in line]
    assert len(ours) == 2 and "reuse=hit" in ours[1], turns
    assert "signature  verified" in out
    assert re.search(r"handle     live, \d+ tokens of KV on D, expires in \d+ s", out), out
    assert re.search(r"^  turn\s+2$", out, re.MULTILINE), out
    assert f"GET /admin/conversations/chat-42?tenant={tenant}" in out


def test_show_json_is_the_same_report(stack: Stack) -> None:
    status, out = show(stack, "chat-42", "--api-key", API_KEY, "--json")
    assert status == 0, out
    report = json.loads(out)
    assert report["key"] == stored_key(stack) and report["exists"] is True
    assert report["signature"] == "verified"
    assert report["handle"]["present"] is True and report["handle"]["expires_in_s"] > 0
    assert report["state"]["turn"] == 2 and report["ttl_s"] > 0


def test_another_key_or_secret_is_said(stack: Stack) -> None:
    status, out = show(stack, "chat-42", "--api-key", "sk-someone-else")
    assert status == 1 and "no session stored under" in out, out
    status, out = show(stack, "chat-42", "--api-key", API_KEY, secret="another-secret-16+chars")
    assert status == 0 and "signature  FAILS" in out, out
    status, out = show(stack, "chat-42", "--api-key", API_KEY, secret=None)
    assert status == 0 and "signature  not checked (set KVBATON_SESSION_SECRET" in out, out


def test_a_redis_that_does_not_answer_is_one_line(stack: Stack) -> None:
    argv = [sys.executable, "-m", "router", "session", "show", "x", "--redis-url"]
    argv.append("redis://:pw@127.0.0.1:1/0")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert done.stderr.startswith("kvbaton session show: Redis at redis://:***@127.0.0.1:1/0")
    assert "pw@" not in done.stderr and "Traceback" not in done.stderr
