"""The Responses API as its clients use it (issue 54): `store` (the default) and
`previous_response_id` through the OpenAI SDK, the chain expanded by the router and keyed as
one conversation so that turns 2+ pull D's KV; GET, input_items and DELETE scoped to the
tenant; two replicas on one Redis continuing each other's chains."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from harness import chat
from harness.chat import MODEL, client, post
from harness.metrics import metric
from harness.procs import wait_until
from harness.stack import Stack, start_stack
from tests.e2e.conftest import BIDIR, pulled
from tests.e2e.helpers import decoder_pins

INSTRUCTIONS = "Answer like a lighthouse keeper: short words only."
SCALE_OUT = "--enable-scale-out"  # P and D serve /v1/responses/render: turns verified by tokens


@pytest.fixture(scope="module")
def replicas(redis_url_session: str) -> Iterator[Stack]:
    """One P and one D (bidirectional), a reference engine, two routers on one Redis."""
    with start_stack(
        prefill=[(*BIDIR, SCALE_OUT)],
        decode=[(*BIDIR, SCALE_OUT)],
        reference=(),
        routers=[(), ()],
        redis=redis_url_session,
        name="respstore",
        router_attempts=2,
    ) as st:
        yield st


def reference(stack: Stack, items: list[dict[str, Any]]) -> str:
    """The from-scratch answer to the whole conversation (the simulator's answer oracle)."""
    out = client(stack.ref.url + "/v1").responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=items,  # type: ignore[arg-type]
        max_output_tokens=24,
    )
    return out.output_text


def turn(
    api: openai.OpenAI, text: str, previous: str | None, *, stream: bool, **extra: Any
) -> tuple[str, str, dict[str, Any]]:
    """One SDK call with only the new input: (answer, X-KV-Reuse, the finished response)."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": text,
        "max_output_tokens": 24,
        **extra,
    }
    if previous is not None:
        kwargs["previous_response_id"] = previous
    return chat.responses_turn(api, kwargs, stream=stream)


def chain(
    stack: Stack, apis: list[openai.OpenAI], label: str, *, stream: bool | None
) -> list[tuple[str, str]]:
    """Four turns, each sending only its new input and the previous response's id (turn i
    through apis[i % len(apis)]; stream None: alternating); every answer the oracle's.
    Each turn's (response id, X-KV-Reuse)."""
    items: list[dict[str, Any]] = []
    previous: str | None = None
    out = []
    for i in range(4):
        text = f"{label} {i}: how is the sea tonight?"
        items.append({"role": "user", "content": text})
        streamed = i % 2 == 1 if stream is None else stream
        answer, reuse, done = turn(apis[i % len(apis)], text, previous, stream=streamed)
        assert answer == reference(stack, items), f"turn {i + 1}"
        assert done["status"] in ("completed", "incomplete") and "kv_transfer_params" not in done
        items.append({"role": "assistant", "content": answer})
        previous = done["id"]
        out.append((previous, reuse))
    return out


@pytest.mark.parametrize("stream", [True, False, None], ids=["sse", "json", "mixed"])
def test_a_chain_of_previous_response_ids_pulls_from_d(
    replicas: Stack, stream: bool | None
) -> None:
    api = client(replicas.routers[0].base_url)
    before = pulled(replicas.p.url)
    turns = chain(replicas, [api], f"chain-{stream}", stream=stream)
    assert turns[0][1] == "miss;reason=no-session"
    assert [reuse for _, reuse in turns[1:]] == ["hit"] * 3
    assert pulled(replicas.p.url) > before
    assert len({rid for rid, _ in turns}) == 4


def test_two_replicas_continue_each_others_chains(replicas: Stack) -> None:
    apis = [client(r.base_url) for r in replicas.routers]
    turns = chain(replicas, apis, "replicas", stream=None)
    assert [reuse for _, reuse in turns[1:]] == ["hit"] * 3
    for api in apis:  # each replica reads what the other stored
        assert api.responses.retrieve(turns[-1][0]).id == turns[-1][0]


def test_get_input_items_and_delete_are_tenant_scoped(replicas: Stack) -> None:
    url = replicas.routers[0].base_url
    mine, theirs = client(url, api_key="key-of-a"), client(url, api_key="key-of-b")
    first, _, done1 = turn(mine, "Where is the lamp?", None, stream=False)
    second, _, done2 = turn(mine, "And the oil?", done1["id"], stream=True)
    rid = done2["id"]
    got = mine.responses.retrieve(rid)
    assert got.output_text == second and got.store is True
    assert got.previous_response_id == done1["id"]
    listed = mine.responses.input_items.list(rid, order="asc")
    texts = [getattr(item, "content", [None])[0] for item in listed.data]
    assert [t.text for t in texts] == ["Where is the lamp?", first, "And the oil?"]
    assert listed.data[0].id == listed.first_id and not listed.has_more
    page = mine.responses.input_items.list(rid, limit=1)  # newest first
    assert page.data[0].content[0].text == "And the oil?" and page.has_more  # type: ignore[union-attr]
    for call in (
        lambda: theirs.responses.retrieve(rid),
        lambda: theirs.responses.delete(rid),
        lambda: theirs.responses.input_items.list(rid),
        lambda: turn(theirs, "Mine now?", rid, stream=False),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    mine.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(rid)
    with pytest.raises(openai.NotFoundError, match=rid):
        turn(mine, "Still there?", rid, stream=False)
    assert mine.responses.retrieve(done1["id"]).id == done1["id"]  # the chain's others stay


def test_deleting_the_last_response_releases_what_d_pins(replicas: Stack) -> None:
    api = client(replicas.routers[0].base_url)
    before = decoder_pins(replicas)
    _, _, done = turn(api, "Ring the bell once.", None, stream=False)
    held = decoder_pins(replicas) - before
    assert len(held) == 1
    reply = post(
        f"{replicas.routers[1].url}/v1/responses/{done['id']}",
        method="DELETE",
        headers={"authorization": "Bearer test-key"},
    )
    assert reply.status == 200 and reply.headers["x-request-id"]
    assert reply.json() == {"id": done["id"], "object": "response.deleted", "deleted": True}
    wait_until(lambda: not held & decoder_pins(replicas), "the deleted response's blocks freed", 10)


def test_an_unknown_previous_response_id_is_a_404_naming_it(replicas: Stack) -> None:
    body = {"model": MODEL, "input": "hi", "previous_response_id": "resp_nowhere"}
    reply = post(replicas.routers[0].url + "/v1/responses", body)
    assert reply.status == 404 and reply.headers["x-request-id"]
    error = reply.json()["error"]
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id" and "resp_nowhere" in error["message"]
    assert error["type"] == "invalid_request_error"
    missing = post(replicas.routers[0].url + "/v1/responses/resp_nowhere", method="GET")
    assert missing.status == 404 and missing.json()["error"]["code"] == "response_not_found"


def test_store_false_keeps_nothing(replicas: Stack) -> None:
    api = client(replicas.routers[0].base_url)
    _, _, done = turn(api, "Forget this.", None, stream=True, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(done["id"])
    with pytest.raises(openai.NotFoundError):
        turn(api, "And this?", done["id"], stream=False)


def test_branches_from_one_response_answer_exactly(replicas: Stack) -> None:
    api = client(replicas.routers[0].base_url)
    root_text = "Two ships pass."
    root_answer, _, root = turn(api, root_text, None, stream=False)
    base = [{"role": "user", "content": root_text}, {"role": "assistant", "content": root_answer}]
    reuses = []
    for branch in ("Which one is first?", "Which one is last?"):
        answer, reuse, done = turn(api, branch, root["id"], stream=True)
        items = [*base, {"role": "user", "content": branch}]
        assert answer == reference(replicas, items), branch
        reuses.append(reuse)
        more, _, _ = turn(api, "Why?", done["id"], stream=False)
        items += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        assert more == reference(replicas, items)
    assert reuses[0] == "hit"


def test_a_tampered_record_is_not_served(replicas: Stack) -> None:
    api = client(replicas.routers[0].base_url)
    _, _, done = turn(api, "Sign here.", None, stream=False)
    assert replicas.redis_url is not None
    store = redis.Redis.from_url(replicas.redis_url)
    [key] = list(store.scan_iter(match=f"kvbaton:resp:*:{done['id']}}}"))
    assert store.ttl(key) > 3000  # --response-ttl's default: an hour
    value = store.get(key)
    assert value is not None
    store.set(key, value.replace(b"Sign here.", b"Sign there"), keepttl=True)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(done["id"])
    store.close()


def test_conversation_and_prompt_cache_key_name_the_session(replicas: Stack) -> None:
    api = client(replicas.routers[0].base_url)
    items: list[dict[str, Any]] = []
    named = {"conversation": {"id": f"conv-{uuid.uuid4().hex[:8]}"}, "store": False}
    for i in range(2):
        items.append({"role": "user", "content": f"Named {i}: fog?"})
        kwargs = {"model": MODEL, "instructions": INSTRUCTIONS, "input": list(items)}
        answer, reuse, _ = chat.responses_turn(
            api, {**kwargs, "max_output_tokens": 24, **named}, stream=False
        )
        assert answer == reference(replicas, items)
        assert reuse == ("hit" if i else "miss;reason=no-session")
        items.append({"role": "assistant", "content": answer})
    key = f"pck-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Cache key: storm?"}]
    first = chat.chat_turn(api, messages, cid=None, extra={"prompt_cache_key": key})
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Then?"}]
    second = chat.chat_turn(api, messages, cid=None, extra={"prompt_cache_key": key})
    assert second.reuse == "hit"


def test_a_chain_past_ds_context_is_refused_before_p(replicas: Stack) -> None:
    api = client(replicas.routers[0].base_url)
    long = " ".join(["the", "of", "and", "to"][i % 4] for i in range(5000))  # a token each
    _, _, done = turn(api, long, None, stream=False)
    computed = metric(replicas.p.url, "vllm:prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as refused:
        turn(api, long, done["id"], stream=False)
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "context_length_exceeded", error
    assert "maximum context length is 8192" in error["message"]
    # P computed nothing for it: at most the one token of releasing the handle the turn took.
    assert metric(replicas.p.url, "vllm:prompt_tokens_total") - computed <= 1
