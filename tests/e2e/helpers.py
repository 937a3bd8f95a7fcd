"""What several e2e files share besides conftest's stacks: the conversations' system prompt and
a checked turn of theirs, the KV-events flags and the wait for the router's index, a Responses
API turn and its reference, D's pins, and the push connector's flags."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import openai

from harness import chat
from harness.chat import chat_turn, client, get_json
from harness.procs import free_port
from harness.stack import Stack
from harness.waiting import scaled
from tests.e2e.conftest import p_route_calls, pulled, reference_chat

# The system prompt of the conversations in test_conversation and the files built on them.
SYSTEM = "You are a terse assistant that answers in short words about the weather and tea."
LONG = " ".join([SYSTEM] * 6)  # a system prompt of many blocks, shared by conversations


def checked_turn(
    stack: Stack, api: openai.OpenAI, messages: list[dict[str, str]], turn: int, **kw: Any
) -> None:
    """Turn `turn` of a conversation (chat_turn's keywords): turn 1 misses, later turns hit
    with P pulling from D, P getting the prompt as the token ids of its own /tokenize (on
    /v1/completions: it does not render the chat again); the answer equals the reference
    engine's and joins `messages`."""
    before, (chats, ids_legs) = pulled(stack.p.url), p_route_calls(stack.p.url)
    answer, reuse, _ = chat_turn(api, messages, **kw)
    assert answer == reference_chat(stack, messages, 24), f"turn {turn}"
    if turn == 1:
        assert reuse == "miss;reason=no-session"
        assert p_route_calls(stack.p.url) == (chats + 1, ids_legs)
    else:
        assert reuse == "hit", f"turn {turn}: {reuse}"
        assert pulled(stack.p.url) > before, f"turn {turn}: P pulled nothing from D"
        assert p_route_calls(stack.p.url) == (chats, ids_legs + 1), f"turn {turn}"
    messages.append({"role": "assistant", "content": answer})


def events_flags() -> tuple[str, ...]:
    """An engine's KV-events publisher and replay ports, free ones."""
    return ("--kv-events-port", str(free_port()), "--kv-events-replay-port", str(free_port()))


def flag(flags: tuple[str, ...], name: str) -> str:
    return flags[flags.index(name) + 1]


def spec(url: str, flags: tuple[str, ...]) -> str:
    """The router's `--kv-events` value for the engine at `url` started with `flags`."""
    pub, rep = flag(flags, "--kv-events-port"), flag(flags, "--kv-events-replay-port")
    return f"{url}=tcp://127.0.0.1:{pub},tcp://127.0.0.1:{rep}"


def status(st: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(st.url + "/status", timeout=5) as resp:
        body: dict[str, Any] = json.loads(resp.read())
    return body


def wait_in_sync(st: Stack, timeout: float = 10.0) -> None:
    """Until the router's index of every engine's KV events is in sync."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        engines = status(st)["kv_events"]["engines"]
        if all(e["in_sync"] for e in engines.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV events never in sync: {engines}")
        time.sleep(0.1)


def indexed(st: Stack, url: str) -> int:
    """The blocks the router's index holds for the engine at `url`."""
    return int(status(st)["kv_events"]["engines"][url]["blocks"])


# The Responses API turns' instructions (tests/e2e/test_responses.py).
INSTRUCTIONS = "Answer like a weather station: short words only."


def responses_reference(stack: Stack, items: list[dict[str, Any]]) -> str:
    """The reference engine's answer to the Responses API turn `items`, from scratch."""
    ref = client(stack.ref.url + "/v1")
    out = ref.responses.create(
        model="sim-model",
        instructions=INSTRUCTIONS,
        input=items,  # type: ignore[arg-type]
        max_output_tokens=24,
    )
    return out.output_text


def responses_turn(
    api: openai.OpenAI, items: list[dict[str, Any]], *, stream: bool, cid: str
) -> tuple[str, str, dict[str, Any]]:
    """One turn: (answer, X-KV-Reuse, the completed response as a dict)."""
    kwargs: dict[str, Any] = {
        "model": "sim-model",
        "instructions": INSTRUCTIONS,
        "input": items,
        "max_output_tokens": 24,
        "extra_body": {"conversation_id": cid},
    }
    return chat.responses_turn(api, kwargs, stream=stream)


def decoder_pins(st: Stack, url: str = "") -> set[str]:
    """D's request ids whose blocks it pins for a reader (kind "decoder": D's, not P's); of
    the D at `url` if given, else of the stack's first D."""
    state = get_json((url or st.d.url) + "/sim/state")
    return {p["request_id"] for p in state["pins"] if p["kind"] == "decoder"}


# The simulators' flags for push mode (`--kv-connector nixl-push`): P's, then D's.
PUSH = ("--kv-connector", "nixl-push", "--kv-lease-duration", "3")
D_PUSH = (*PUSH, "--push-registration-timeout", "3")
