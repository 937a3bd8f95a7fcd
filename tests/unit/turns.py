"""Whole turns through the fake engines and the in-memory store, for the unit tests: two P and
two D, a turn, a conversation, its stored state, and the releaser of D's pinned handles."""

from __future__ import annotations

from typing import Any

import msgspec

from router.config import Settings
from router.lifecycle import pin_sweep
from router.services import Services
from router.turn.incoming import Accepts, Api, Incoming, read_incoming
from router.turn.run import run_turn
from router.turn.tenant import DEFAULT_TENANT
from sessions.keys import conversation_key
from sessions.model import SessionState
from tests.support.services import make_services
from tests.unit.fake_engines import BLOCK, Call, FakeEngines, answer_for, render, token_ids

P1, P2, D1, D2 = "http://p1", "http://p2", "http://d1", "http://d2"


def services(engines: FakeEngines, **settings: Any) -> Services:
    """P1, P2, D1 and D2 behind `engines`; `settings` override the Settings. A pull is
    preferred to the decode plan while P has room, even on an idle D, unless `settings` say
    otherwise (as the e2e tests' routers: tests/conftest.py's PULL_FIRST_ENV)."""
    settings.setdefault("decode_local_idle_inflight", 0)
    config = Settings(
        prefill=(P1, P2), decode=(D1, D2), block_size=BLOCK, check_models=False, **settings
    )
    return make_services(config, engines, model="m", block_size=BLOCK)


def incoming(body: dict[str, Any], api: Api = "chat") -> Incoming:
    """A client's JSON body as the router reads it (model "m", 1 MiB at most)."""
    return read_incoming(
        msgspec.json.encode(body),
        {"content-type": "application/json"},
        api,
        Accepts(model="m", max_bytes=1 << 20),
    )


async def send(
    svc: Services, body: dict[str, Any], request_id: str = "rid", api: Api = "chat"
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One turn of `body` through `run_turn`: its status, headers and decoded body."""
    resp = await run_turn(svc, incoming(body, api), request_id)
    return resp.status_code, dict(resp.headers), msgspec.json.decode(bytes(resp.body))


async def turn(
    svc: Services, messages: list[dict[str, Any]], request_id: str = "rid", cid: str | None = "c1"
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One chat turn of conversation `cid` (None: none) through `run_turn`."""
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if cid is not None:
        body["conversation_id"] = cid
    return await send(svc, body, request_id)


def answer(body: dict[str, Any]) -> str:
    content: str = body["choices"][0]["message"]["content"]
    return content


async def conversation(svc: Services, turns: int) -> list[tuple[int, dict[str, str], str]]:
    """`turns` turns of one conversation, each answer carried into the next prompt."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    seen = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question number {i}?"})
        status, headers, body = await turn(svc, messages, request_id=f"r{i}")
        seen.append((status, headers, answer(body) if status == 200 else ""))
        if status == 200:
            messages.append({"role": "assistant", "content": answer(body)})
    return seen


async def state_of(svc: Services) -> SessionState:
    state = await svc.store.get(conversation_key(DEFAULT_TENANT, "c1"))
    assert state is not None
    return state


def handle_sent(call: Call) -> bool:
    return call.body["kv_transfer_params"].get("remote_block_ids") is not None


def expected_answer(messages: list[dict[str, Any]]) -> str:
    return answer_for(token_ids(render(messages)))


def second_turn(question: str) -> list[dict[str, Any]]:
    """The messages of the second turn of `conversation(svc, 1)`'s conversation."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "question number 0?"},
    ]
    messages.append({"role": "assistant", "content": expected_answer(messages)})
    return [*messages, {"role": "user", "content": question}]


def crowd_prefill(svc: Services) -> None:
    """Both P as crowded as --decode-local-max-inflight 1: the decode plan beats a pull."""
    for inst in svc.pool.instances("prefill"):
        inst.outstanding = 1


def releasing(engines: FakeEngines, **settings: Any) -> Services:
    """`services` with its releaser of pinned handles started (stop it at the end)."""
    svc = services(engines, **settings)
    svc.releaser = pin_sweep.releaser(svc)
    assert svc.releaser is not None
    svc.releaser.start()
    return svc


def releases(engines: FakeEngines) -> list[dict[str, Any]]:
    """The read-nothing requests P got: their kv_transfer_params."""
    return [
        c.body["kv_transfer_params"]
        for c in engines.calls
        if c.url.startswith((P1, P2))
        and c.url.endswith("/v1/completions")
        and c.body.get("prompt") == [0]
    ]


def counted(svc: Services, reason: str) -> float:
    """The handles released for `reason`, as the metric counts them."""
    labels = {"reason": reason, "outcome": "released"}
    return svc.metrics.registry.get_sample_value("kvbaton_pin_releases_total", labels) or 0.0
