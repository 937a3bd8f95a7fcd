"""`--kv-connector store` through whole turns on the fake engines: no kv_transfer_params to P
or D, affinity kept, and the verdict taken from what P reports cached (never guessed)."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Settings
from router.connectors.names import ConnectorName
from router.connectors.select import select
from router.connectors.store.connector import StoreConnector
from router.connectors.store.params import prompt_usage
from router.turn.decide.handleless import store as verdict
from router.turn.outcomes import Reason, Reuse, Via
from tests.unit.fake_engines import FakeEngines
from tests.unit.turns import D1, P1, conversation, services, state_of


class StoreEngines(FakeEngines):
    """Store-mode engines: P returns no params and reports `cached` prompt tokens (None: no
    prompt_tokens_details, as vLLM omits them at 0; -1: no usage at all)."""

    cached: int | None = None

    def _prefill(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        out = super()._prefill(url, body)
        out["kv_transfer_params"] = None
        n = 40
        if self.cached == -1:
            return out
        out["usage"] = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
        if self.cached is not None:
            out["usage"]["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out

    def _decode(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        out = super()._decode(url, body)
        out["kv_transfer_params"] = None
        return out


def sample(svc: Any, name: str, **labels: str) -> float:
    value = svc.metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


async def test_store_mode_sends_no_fields_keeps_affinity_and_reports_what_p_found() -> None:
    engines = StoreEngines()
    engines.cached = 32
    svc = services(engines, kv_connector="store")
    seen = await conversation(svc, 3)
    assert [h["x-kv-reuse"] for _, h, _ in seen] == [
        "miss;reason=no-session",
        "hit;via=store",
        "hit;via=store",
    ]
    for call in engines.calls:
        assert "kv_transfer_params" not in call.body, call
    assert {c.url.split("/v1/")[0] for c in engines.calls} == {P1, D1}  # affinity
    state = await state_of(svc)
    assert state.kv_transfer_params is None and state.prefill == P1 and state.decode == D1
    assert sample(svc, "kvbaton_kv_reused_tokens_total", source="store") == 64
    assert sample(svc, "kvbaton_store_prompt_tokens_total", source="cached") == 96
    assert sample(svc, "kvbaton_store_prompt_tokens_total", source="computed") == 3 * 40 - 96


@pytest.mark.parametrize(
    ("cached", "second"), [(None, "miss;reason=store-missed"), (0, "miss;reason=store-missed")]
)
async def test_a_p_that_found_nothing_is_an_honest_miss(cached: int | None, second: str) -> None:
    engines = StoreEngines()
    engines.cached = cached
    svc = services(engines, kv_connector="store")
    seen = await conversation(svc, 2)
    assert seen[1][1]["x-kv-reuse"] == second
    assert sample(svc, "kvbaton_store_prompt_tokens_total", source="computed") == 80


async def test_a_p_answer_without_usage_leaves_the_claim_s_verdict() -> None:
    engines = StoreEngines()
    engines.cached = -1
    svc = services(engines, kv_connector="store")
    seen = await conversation(svc, 2)
    assert seen[1][1]["x-kv-reuse"] == "miss;reason=no-kv-params"
    assert sample(svc, "kvbaton_store_prompt_tokens_total", source="cached") == 0


def test_verdict() -> None:
    first = Reuse.miss(Reason.NO_SESSION)
    assert verdict(first, False, 50) == first
    skip = Reuse.miss(Reason.NO_CONVERSATION_ID)
    assert verdict(skip, True, 50) == skip
    claimed = Reuse.miss(Reason.NO_KV_PARAMS)
    assert verdict(claimed, True, 50) == Reuse.hit(50, via=Via.STORE)
    assert verdict(claimed, True, 0) == Reuse.miss(Reason.STORE_MISSED)
    # With KV events: what P's own cache held before the leg tells its part from the store's.
    assert verdict(claimed, True, 50, local=50) == Reuse.hit(50, via=Via.PREFILL_CACHE)
    assert verdict(claimed, True, 50, local=34) == Reuse.hit(50, via=Via.STORE)
    assert verdict(claimed, True, 0, local=34) == Reuse.miss(Reason.STORE_MISSED)
    assert Reuse.hit(50, via=Via.STORE).source == "store"


def test_prompt_usage() -> None:
    assert prompt_usage({}) is None
    assert prompt_usage({"usage": None}) is None
    assert prompt_usage({"usage": {"prompt_tokens": 9}}) == (9, 0)
    chat = {"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}}
    assert prompt_usage(chat) == (9, 4)
    responses = {"usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 5}}}
    assert prompt_usage(responses) == (9, 5)
    odd = {"usage": {"prompt_tokens": True, "prompt_tokens_details": {"cached_tokens": -3}}}
    assert prompt_usage(odd) == (None, 0)


def test_the_store_connector_has_no_fields_and_no_handle() -> None:
    c = select(Settings(prefill=(P1,), decode=(D1,), kv_connector=ConnectorName.STORE))
    assert isinstance(c, StoreConnector)
    assert not c.caps.reuses_d_to_p and not c.caps.decode_plan and not c.caps.p_hands_off
    assert c.prefill_params(None) == {} and c.decode_params({"x": 1}) is None
    assert not c.is_handle({"remote_block_ids": [[1]]}) and c.engine_id({}) is None
    assert c.prefill_failed(500, None) and not c.prefill_failed(200, {"choices": []})
    with pytest.raises(ValueError):
        c.truncate({}, 16, 16)
