"""A Responses conversation through the router on real vLLM 0.32 whose P and D serve the
render routes (--enable-scale-out): each later turn verified by P's /v1/responses/render
against D's token ids (enable_response_messages), exact answers. Run by the char and the BPE
modules on their engines."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harness.chat import post, responses_turn
from harness.metrics import metric
from harness.router import RouterProc
from tests.vllm.conftest import Engines
from tests.vllm.engines import MODEL_NAME, by_source, failed_transfers
from tests.vllm.turns import MAX_TOKENS, client, moved_if_hit, opening, session_fields

RENDER = "/v1/responses/render"


def reference(engines_: Engines, items: list[Any]) -> str:
    """The from-scratch answer of the engine without a connector, on /v1/responses."""
    with client(engines_.ref.url + "/v1") as ref:
        out = ref.responses.create(
            model=MODEL_NAME,
            input=items,
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
    return out.output_text


def turn(r: RouterProc, items: list[Any], cid: str, *, stream: bool) -> tuple[str, str, Any]:
    """One /v1/responses turn: (answer, X-KV-Reuse, the completed response as a dict)."""
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": items,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"conversation_id": cid},
    }
    with client(r.base_url) as api:
        return moved_if_hit(r, lambda: responses_turn(api, kwargs, stream=stream))


def renders(url: str) -> float:
    return metric(url, "http_requests_total", timeout=120, handler=RENDER, status="2xx")


def reused(r: RouterProc) -> float:
    return sum(
        metric(r.url, "kvbaton_kv_reused_tokens_total", source=s)
        for s in ("decode_pull", "prefill_cache")
    )


@dataclass(frozen=True)
class Verdict:
    reuse: str
    reused: int  # tokens the router's verdict reused
    held: int  # tokens D held (its handle's remote_num_tokens)


def default_engine_refuses_render(engines_: Engines) -> None:
    """vLLM's default (the reference engine, no --enable-scale-out): 403."""
    reply = post(engines_.ref.url + RENDER, {"model": MODEL_NAME, "input": "hi"}, timeout=120)
    assert reply.status == 403, reply.body[:300]
    error = json.loads(reply.body)["error"]
    assert error["type"] == "PermissionDeniedError" and "--enable-scale-out" in error["message"]


def conversation(engines_: Engines, r: RouterProc, redis_url: str, tag: str) -> list[Verdict]:
    """A 3-turn Responses conversation (the opening without a uuid: the same greedy answers
    on every run), turn 2 streamed, each answer sent back as its output item. Every
    answer equals the from-scratch one; every later turn is verified by P's render and reuses
    at most what D held, with no failed transfer, and P reads from D. (Whether a `hit` whose
    blocks P already held says so is the KV-events check's business, test_real_vllm_bpe's
    first test: blocks P read from D are in its cache but not in its KV events.)"""
    p = engines_.p.url
    cid = f"{tag}-resp"
    items: list[Any] = list(opening(tag, unique=False))
    verdicts = []
    held = 0
    external = by_source(p, "external_kv_transfer")
    for n in range(1, 4):
        asked, before, failed = renders(p), reused(r), failed_transfers(p)
        answer, reuse, completed = turn(r, items, cid, stream=n % 2 == 0)
        assert answer == reference(engines_, items), f"{tag} turn {n}"
        assert completed["input_messages"] is None, "D's token ids are the router's"
        assert failed_transfers(p) == failed
        got = int(reused(r) - before)
        if n == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse in ("hit", "hit;via=prefill-cache"), f"{tag} turn {n}: {reuse}"
            assert renders(p) == asked + 1, f"{tag} turn {n}: not verified by P's render"
            assert 0 < got <= held, (got, held)
            verdicts.append(Verdict(reuse, got, held))
        _, fields = session_fields(redis_url, cid)
        held = int(fields["token_count"])
        assert held > 0 and fields["kv_transfer_params"], f"{tag} turn {n}: no handle kept"
        items += [completed["output"][-1], {"role": "user", "content": f"And in hour {n}?"}]
    assert by_source(p, "external_kv_transfer") > external, f"{tag}: P never read from D"
    return verdicts
