"""What the previous D lacks of a new prompt, bounded from the state alone
(router/turn/decide/lacks.py): no /tokenize, so the decode plan is decided before anything
is paid. A table of prompts against one conversation's state."""

from __future__ import annotations

from typing import Any

import pytest

from router.turn.decide.lacks import PER_MESSAGE, PER_TURN, Lacks, estimate, held
from router.turn.incoming import Incoming
from sessions import model as sm

PROMPT = [{"role": "user", "content": "Will it rain on the tea plantation?"}]
ANSWER = {"role": "assistant", "content": "Not today."}
ASKED = {"role": "user", "content": "And tomorrow?"}  # 13 bytes
# D computed the prompt and its answer: 70 tokens, 4 full blocks of 16 before its last token.
CHAT = sm.SessionState(
    api="chat",
    prompt_digest=sm.conversation_digest("chat", PROMPT),
    prompt_len=1,
    prefix_digest=sm.conversation_digest("chat", [*PROMPT, ANSWER]),
    prefix_len=2,
    token_count=70,
    block_size=16,
)


def chat(messages: list[Any]) -> Incoming:
    return Incoming("chat", {"messages": messages}, False, "c", "default", False)


def test_held_is_the_full_blocks_before_ds_last_token() -> None:
    assert [held(n, 16) for n in (0, 1, 16, 17, 32, 33, 70)] == [0, 0, 0, 16, 16, 32, 64]
    assert held(70, 0) == 0


def test_a_new_message_lacks_its_bytes_the_template_and_ds_partial_block() -> None:
    got = estimate(chat([*PROMPT, ANSWER, ASKED]), CHAT)
    assert got == Lacks(new=70 - 64 + 13 + PER_MESSAGE + PER_TURN, holds=64)


def test_text_parts_and_tool_fields_are_bounded_too() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}
    assert estimate(chat([*PROMPT, ANSWER, parts]), CHAT) == estimate(
        chat([*PROMPT, ANSWER, ASKED]), CHAT
    )
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "dry"}
    got = estimate(chat([*PROMPT, ANSWER, tool]), CHAT)
    assert got is not None and got.new > 70 - 64 + len("dry") + PER_MESSAGE + PER_TURN


@pytest.mark.parametrize(
    ("case", "messages", "state"),
    [
        ("an edited history", [PROMPT[0], {**ANSWER, "content": "Yes."}, ASKED], CHAT),
        ("an image", [*PROMPT, ANSWER, {"role": "user", "content": [{"type": "image_url"}]}], CHAT),
        ("no token count", [*PROMPT, ANSWER, ASKED], sm.SessionState(api="chat")),
        ("another API's state", [*PROMPT, ANSWER, ASKED], sm.SessionState(api="responses")),
    ],
)
def test_what_the_state_cannot_bound(case: str, messages: list[Any], state: Any) -> None:
    assert estimate(chat(messages), state) is None, case


def test_a_text_prompt_lacks_the_bytes_after_ds_text() -> None:
    prompt, out = "The lighthouse keeper wrote that", " the sea was calm."
    state = sm.SessionState(
        api="completions",
        prefix_digest=sm.text_digest("completions", prompt + out),
        prefix_len=len(prompt + out),
        token_count=40,
        block_size=16,
    )
    inc = Incoming("completions", {"prompt": prompt + out + " Then"}, False, "c", "default", False)
    assert estimate(inc, state) == Lacks(new=40 - 32 + len(" Then"), holds=32)
    edited = Incoming("completions", {"prompt": "Another" + out}, False, "c", "default", False)
    assert estimate(edited, state) is None


def test_a_token_id_prompt_is_checked_against_ds_own_tokens() -> None:
    seq = list(range(100, 140))  # D's 40 tokens
    state = sm.SessionState(
        api="completions", token_count=40, block_size=16, seq_digest=sm.sequence_digest(seq)
    )

    def ids(prompt: list[int]) -> Incoming:
        return Incoming("completions", {"prompt": prompt}, False, "c", "default", False)

    assert estimate(ids([*seq, 7, 8, 9]), state) == Lacks(new=43 - 32, holds=32)
    assert estimate(ids([1, *seq[1:], 7]), state) == Lacks(new=41, holds=0)
