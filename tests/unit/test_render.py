"""Responses turns verified by P's /v1/responses/render (router/turn/render.py), through the
fake engines and the in-memory store: token-exact hits and partial reuse where P renders, the
item-digest check where it does not (403 without --enable-scale-out, 404 without the route),
learned once per engine."""

from __future__ import annotations

from typing import Any

import pytest

from router.errors import UpstreamFailure
from router.turn.render import not_served
from tests.unit.fake_engines import (
    Call,
    FakeEngines,
    answer_for,
    render,
    responses_messages,
    token_ids,
)
from tests.unit.turns import P1, P2, crowd_prefill, send, services, state_of

INSTRUCTIONS = "be brief"


async def respond(
    svc: Any, items: list[dict[str, Any]], request_id: str
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": "m", "instructions": INSTRUCTIONS, "input": items, "conversation_id": "c1"}
    return await send(svc, body, request_id, api="responses")


def text_of(body: dict[str, Any]) -> str:
    text: str = body["output"][0]["content"][0]["text"]
    return text


def expected(items: list[dict[str, Any]]) -> str:
    body = {"instructions": INSTRUCTIONS, "input": items}
    return answer_for([1, *token_ids(render(responses_messages(body)))])


def renders(engines: FakeEngines) -> list[str]:
    return [c.url for c in engines.calls if c.url.endswith("/v1/responses/render")]


def p_handles(engines: FakeEngines) -> list[int | None]:
    """remote_num_tokens of each P leg's handle (None: the null handoff)."""
    legs = [c for c in engines.calls if c.url.startswith("http://p") and "/render" not in c.url]
    return [c.body["kv_transfer_params"].get("remote_num_tokens") for c in legs]


async def three_turns(svc: Any, engines: FakeEngines) -> list[str]:
    """A three-turn conversation, each answer sent back as its output item."""
    items: list[dict[str, Any]] = []
    reuse = []
    for i in range(3):
        items.append({"role": "user", "content": f"question number {i}?"})
        status, headers, body = await respond(svc, items, f"r{i}")
        assert status == 200 and text_of(body) == expected(items)
        assert body["input_messages"] is None, "the token ids the router asked for are cut"
        reuse.append(headers["x-kv-reuse"])
        items.append(body["output"][0])
    return reuse


async def test_a_responses_conversation_is_verified_by_p_s_render() -> None:
    engines = FakeEngines()
    svc = services(engines)
    assert await three_turns(svc, engines) == ["miss;reason=no-session", "hit", "hit"]
    d_legs = [c for c in engines.calls if c.url.startswith("http://d")]
    assert all(c.body.get("enable_response_messages") is True for c in d_legs)
    assert len(renders(engines)) == 2  # one per hit, on that turn's P
    state = await state_of(svc)
    assert state.block_digests, "D's token ids recorded for the next turn"


async def test_an_edited_last_answer_reuses_only_the_verified_prefix() -> None:
    engines = FakeEngines()
    svc = services(engines)
    items: list[dict[str, Any]] = [{"role": "user", "content": "tell me a long story please"}]
    _, _, body = await respond(svc, items, "r0")
    held = (await state_of(svc)).token_count
    edited = text_of(body)[:-2] + "!!"
    items += [{"role": "assistant", "content": edited}, {"role": "user", "content": "more?"}]
    status, headers, body = await respond(svc, items, "r1")
    assert (status, headers["x-kv-reuse"]) == (200, "hit")
    assert text_of(body) == expected(items)
    sent = p_handles(engines)[-1]
    assert sent is not None and 0 < sent < held and sent % 4 == 0, "cut to whole blocks"


@pytest.mark.parametrize("status", [403, 404])
async def test_a_prefill_without_render_falls_back_to_digests_once(status: int) -> None:
    engines = FakeEngines(no_render={P1: status, P2: status})
    svc = services(engines)
    assert await three_turns(svc, engines) == ["miss;reason=no-session", "hit", "hit"]
    # Learned from the first answer of each P it went to, never asked again.
    asked = renders(engines)
    assert len(asked) == len(set(asked)) >= 1
    assert all(u.startswith("http://p") for u in asked), "a hit to a P with room: no D render"
    assert all(i.ident.renders is False for i in svc.pool.instances() if asked[0].startswith(i.url))
    # Digests alone send the whole handle (nothing to cut it with).
    items = [{"role": "user", "content": "another?"}]
    _, _, body = await respond(svc, items, "r3")  # a new first turn of conversation c1
    held = (await state_of(svc)).token_count
    items += [body["output"][0], {"role": "user", "content": "and?"}]
    assert (await respond(svc, items, "r4"))[1]["x-kv-reuse"] == "hit"
    assert p_handles(engines)[-1] == held
    assert len(renders(engines)) == len(asked), "not asked again"


async def test_without_render_a_late_divergence_is_a_miss() -> None:
    engines = FakeEngines(no_render={P1: 403, P2: 403})
    svc = services(engines)
    items: list[dict[str, Any]] = [{"role": "user", "content": "tell me a long story please"}]
    _, _, body = await respond(svc, items, "r0")
    items += [
        {"role": "assistant", "content": text_of(body)[:-2] + "!!"},
        {"role": "user", "content": "more?"},
    ]
    status, headers, body = await respond(svc, items, "r1")
    assert (status, headers["x-kv-reuse"]) == (200, "miss;reason=prefix-mismatch")
    assert text_of(body) == expected(items)


def test_what_says_the_route_is_not_served() -> None:
    assert not_served(403, {"error": {"type": "PermissionDeniedError"}})
    assert not_served(404, {"detail": "Not Found"})
    assert not_served(404, None) and not_served(501, {"error": {}}) and not_served(405, None)
    # vLLM's own 404 (an unknown model) is an OpenAI error: the route is there.
    assert not not_served(404, {"error": {"type": "NotFoundError", "param": "model"}})
    assert not not_served(400, {"error": {}}) and not not_served(500, None)


async def test_a_responses_turn_takes_the_decode_plan_when_p_is_crowded() -> None:
    """What D holds of a Responses prompt is known from the render now: a verified hit whose
    P is as crowded as the limit runs on D alone, as chat does."""
    engines = FakeEngines()
    svc = services(engines, decode_local_max_inflight=1)
    items: list[dict[str, Any]] = [{"role": "user", "content": "question?"}]
    _, _, body = await respond(svc, items, "r0")
    first = await state_of(svc)
    crowd_prefill(svc)
    items += [body["output"][0], {"role": "user", "content": "and then?"}]
    calls = len(engines.calls)
    status, headers, body = await respond(svc, items, "r1")
    assert (status, headers["x-kv-reuse"]) == (200, "hit;via=decode")
    assert text_of(body) == expected(items)
    legs = [c for c in engines.calls[calls:] if "/render" not in c.url]
    assert [c.url for c in legs] == [first.decode + "/v1/responses"], "D alone, no P leg"
    # D returned its handle (the decode plan sends it params): the next turn is a hit (P's
    # render verifies it), on D alone again while P is crowded, with no render of D's.
    engines.no_render[first.decode] = 403
    items += [body["output"][0], {"role": "user", "content": "more?"}]
    calls = len(engines.calls)
    status, headers, _ = await respond(svc, items, "r2")
    assert (status, headers["x-kv-reuse"]) == (200, "hit;via=decode")
    legs = [c.url for c in engines.calls[calls:] if not c.url.endswith("/render")]
    assert legs == [first.decode + "/v1/responses"], "D alone, no P leg"


@pytest.mark.parametrize(
    "failure",
    [500, UpstreamFailure("refused", reached=False), "bad-ids"],
    ids=["500", "unreachable", "no-ids"],
)
async def test_a_failed_render_is_a_miss_and_is_asked_again(failure: object) -> None:
    """A render that fails (not a route the engine lacks) verifies nothing: the turn is
    `miss;reason=tokenize-failed` (never a read), and the next turn asks again."""
    engines = FakeEngines()
    svc = services(engines)
    items: list[dict[str, Any]] = [{"role": "user", "content": "question?"}]
    _, _, body = await respond(svc, items, "r0")

    def fail(call: Call) -> int | UpstreamFailure | None:
        if not call.url.endswith("/v1/responses/render"):
            return None
        if failure == "bad-ids":
            engines.render_ids = ["x"]
            return None
        return failure  # type: ignore[return-value]

    engines.scripts[P1] = engines.scripts[P2] = fail
    items += [body["output"][0], {"role": "user", "content": "and then?"}]
    status, headers, body = await respond(svc, items, "r1")
    assert (status, headers["x-kv-reuse"]) == (200, "miss;reason=tokenize-failed")
    assert text_of(body) == expected(items)
    assert all(i.ident.renders is not False for i in svc.pool.instances())
