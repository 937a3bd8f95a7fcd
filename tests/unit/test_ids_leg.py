"""The P leg by token ids: when it is allowed, its body, and the switch that turns it off when
D renders a prompt into other ids than P's /tokenize."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Settings
from router.turn.capture import Captured
from router.turn.claim import Claim
from router.turn.commit import next_state
from router.turn.incoming import Incoming
from router.turn.outcomes import Reuse
from router.turn.rewrite import ids_leg_allowed, ids_prefill_body
from router.turn.state import Turn
from tests.support.services import make_services
from tests.unit.handles import D_HANDLE

TEXT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rain?"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]


@pytest.mark.parametrize(
    ("api", "body", "allowed"),
    [
        ("chat", {"messages": TEXT}, True),
        ("chat", {"messages": PARTS}, True),
        ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, True),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            False,
        ),
        ("chat", {"messages": TEXT, "truncate_prompt_tokens": 100}, False),
        ("chat", {"messages": TEXT, "reasoning_effort": "low"}, False),
        ("chat", {"messages": TEXT, "mm_processor_kwargs": {}}, False),
        ("chat", {"messages": ["not a message"]}, False),
        ("completions", {"prompt": "once upon"}, True),
        ("completions", {"prompt": "x", "prompt_embeds": "..."}, False),
        ("responses", {"input": "hi"}, False),
    ],
)
def test_ids_leg_allowed(api: str, body: dict[str, Any], allowed: bool) -> None:
    assert ids_leg_allowed(api, body) is allowed


def test_ids_prefill_body_keeps_only_what_changes_p_kv() -> None:
    body = {
        "model": "m",
        "messages": TEXT,
        "tools": [{"type": "function"}],
        "cache_salt": "tenant-a",
        "priority": 3,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 300,
    }
    out = ids_prefill_body(body, [1, 2, 3], {"do_remote_decode": True})
    assert out == {
        "model": "m",
        "cache_salt": "tenant-a",
        "priority": 3,
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 300 and "prompt" not in body  # the client's body untouched


def _turn(*, enabled: bool = True) -> Turn:
    settings = Settings(
        prefill=("http://p",), decode=("http://d",), prefill_token_ids=enabled, block_size=4
    )
    svc = make_services(settings)
    pool = svc.pool
    inc = Incoming("chat", {"messages": TEXT}, False, "c", "default", False)
    turn = Turn(svc, inc, "req", Claim("k", None, Reuse.miss("no-session")), 0.0)
    turn.prefill, turn.decode = pool.instances("prefill")[0], pool.instances("decode")[0]
    turn.want_token_ids = True
    return turn


def _captured(prompt_ids: list[int]) -> Captured:
    return Captured(
        kv_transfer_params=dict(D_HANDLE),
        finish_reason="stop",
        done=True,
        prompt_token_ids=prompt_ids,
        output_token_ids=[9, 9],
        output_text=" yes",
    )


def test_same_ids_on_d_keep_the_handle_and_the_ids_leg() -> None:
    turn = _turn()
    turn.prefill_ids = [1, 2, 3, 4]
    state = next_state(turn, _captured([1, 2, 3, 4]))
    assert state.kv_transfer_params is not None
    assert turn.svc.ids_leg_on()


def test_other_ids_on_d_drop_the_handle_and_switch_the_ids_leg_off() -> None:
    turn = _turn()
    turn.prefill_ids = [1, 2, 3, 4]
    state = next_state(turn, _captured([1, 2, 3, 5]))
    assert state.kv_transfer_params is None
    assert state.no_handle_reason == "prompt-ids-differ"
    assert not turn.svc.ids_leg_on()
    assert "http://d tokenized a prompt into 4 ids" in turn.svc.ids_leg_off
    turn.svc.switch_ids_leg_off("a later reason")  # the first reason stays
    assert "http://d" in turn.svc.ids_leg_off


def test_a_turn_whose_p_got_the_body_is_not_compared() -> None:
    turn = _turn()
    state = next_state(turn, _captured([7, 7]))
    assert state.kv_transfer_params is not None and turn.svc.ids_leg_on()


def test_the_flag_turns_the_ids_leg_off() -> None:
    assert not _turn(enabled=False).svc.ids_leg_on()
