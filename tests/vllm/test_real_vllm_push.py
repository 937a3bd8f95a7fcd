"""kvbaton in push mode in front of real vLLM 0.32 (CPU build, NixlPushConnector over UCX).

P and D run `NixlPushConnector` (`kv_both`, no `bidirectional_kv_xfer`: vLLM refuses it for
push); the router runs `--kv-connector nixl-push` and is given nothing else: it learns P's
coordinates (engine id, side channel, tp size) from its start-up probe. Each turn calls P
and D at once, D registers the blocks it lacks with P, and P writes them into D: D's
`external_kv_transfer` tokens rise on every turn, and every greedy answer equals P's own
answer to the same request sent without kv_transfer_params (an ordinary request: the push
module starts no third engine). There is no D->P reuse in push mode (vllm#46473): later turns say
`miss;reason=push-affinity` and keep the same P and D, whose prefix caches help.
"""

from __future__ import annotations

import os
import uuid

import pytest

from harness.chat import get_json
from harness.metrics import metric
from harness.router import RouterProc
from tests.vllm.conftest import PYTHON_ENV, Engines
from tests.vllm.engines import by_source, failed_transfers
from tests.vllm.turns import chat, opening, reference, session_fields

if not os.environ.get(PYTHON_ENV):
    pytest.skip(
        f"real-vLLM tier: {PYTHON_ENV} is not set (run `make test-vllm`)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(300)


def test_status_shows_the_learned_push_coordinates(
    vllm_push_engines: Engines, vllm_push_router: RouterProc
) -> None:
    status = get_json(vllm_push_router.url + "/status")
    (p,) = status["instances"]["prefill"]
    assert p["url"] == vllm_push_engines.p.url
    kv = p["kv"]
    assert kv["usable"], kv
    assert kv["coordinates"]["port"] == vllm_push_engines.p.spec.side_channel_port
    assert kv["coordinates"]["source"] != "config"  # learned: the router was given only URLs


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_push_conversation_writes_into_d_every_turn(
    vllm_push_engines: Engines,
    vllm_push_router: RouterProc,
    redis_url_session: str,
    stream: bool,
) -> None:
    p, d = vllm_push_engines.p.url, vllm_push_engines.d.url
    cid = f"push-{uuid.uuid4().hex[:8]}"
    messages = opening("push")
    for turn in range(1, 4):
        written, failed = by_source(d, "external_kv_transfer"), failed_transfers(d)
        answer, reuse, _ = chat(vllm_push_router, messages, cid=cid, stream=stream)
        assert answer == reference(vllm_push_engines, messages), f"turn {turn}"
        expected = "miss;reason=no-session" if turn == 1 else "miss;reason=push-affinity"
        assert reuse == expected, f"turn {turn}: {reuse}"
        assert by_source(d, "external_kv_transfer") > written, f"turn {turn}: P wrote nothing"
        assert failed_transfers(d) == failed
        _, fields = session_fields(redis_url_session, cid)
        assert (fields["prefill"], fields["decode"]) == (p, d)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And in hour {turn}?"},
        ]


def test_a_connect_style_events_endpoint_is_warned_about(
    vllm_push_engines: Engines, vllm_push_router: RouterProc
) -> None:
    """D's --kv-events-config endpoint has no wildcard (tcp://127.0.0.1:PORT): vLLM connects
    instead of binding, the router (which connects too) receives nothing, and once turns ran
    on D it says so in the log, /status and the metric, naming the likely cause. P's
    endpoint binds (ipc://) and is not warned about."""
    p, d = vllm_push_engines.p.url, vllm_push_engines.d.url
    messages = opening("events-endpoint")
    for _ in range(5):  # SILENT_AFTER_TURNS turns on D, whatever ran before
        chat(vllm_push_router, messages, cid=None)
    views = get_json(vllm_push_router.url + "/status")["kv_events"]["engines"]
    assert "without a wildcard" in views[d]["warning"], views[d]
    assert views[p]["warning"] == "" and views[p]["batches"] > 0, views[p]
    assert metric(vllm_push_router.url, "kvbaton_kv_events_warning", instance=d) == 1
    assert "KV events of " + d in vllm_push_router.log.read_text()
