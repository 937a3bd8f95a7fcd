"""A P->D handoff between simulator processes, leg by leg: P's prefill, D's decode with P's
params, the reference's answer from scratch, and the two turns of a conversation."""

from __future__ import annotations

from typing import Any

from harness.chat import NULL_HANDOFF
from harness.procs import SimProc
from tests.sim.client import chat, words


async def prefill(p: SimProc, messages: list[dict[str, Any]], params: dict[str, Any]) -> Any:
    status, body = await chat(p.url, messages, max_tokens=1, kv_transfer_params=params)
    assert status == 200, body
    return body


async def decode(
    d: SimProc, messages: list[dict[str, Any]], params: dict[str, Any] | None, n: int
) -> tuple[int, Any]:
    extra: dict[str, Any] = {"max_tokens": n, "return_token_ids": True}
    if params is not None:
        extra["kv_transfer_params"] = params
    return await chat(d.url, messages, **extra)


async def scratch(r: SimProc, messages: list[dict[str, Any]], n: int) -> tuple[list[int], str]:
    status, body = await decode(r, messages, None, n)
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


def answer(body: Any) -> tuple[list[int], str]:
    choice = body["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


async def turn1(c: dict[str, SimProc], seed: int, p: str = "P", d: str = "D", n: int = 80) -> Any:
    """One P->D turn; returns (messages, D's body)."""
    msgs = [{"role": "user", "content": words(seed, 60)}]
    pb = await prefill(c[p], msgs, NULL_HANDOFF)
    status, db = await decode(c[d], msgs, pb["kv_transfer_params"], n)
    assert status == 200, db
    return msgs, db


def turn2_messages(msgs: list[dict[str, Any]], content: str, seed: int) -> list[dict[str, Any]]:
    return [
        *msgs,
        {"role": "assistant", "content": content},
        {"role": "user", "content": words(seed, 30)},
    ]


def as_p_handle(d_params: dict[str, Any]) -> dict[str, Any]:
    return {**d_params, "do_remote_decode": True, "do_remote_prefill": False}
