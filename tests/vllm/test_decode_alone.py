"""A turn on D alone (the decode plan) against real vLLM 0.32: D gets `kv_transfer_params` with
nothing to read; its bidirectional NixlConnector keeps the blocks and returns its handle, as
after a P/D turn, so that a later turn that cannot run on D alone pulls instead of
recomputing (router/connectors/nixl/params.py, ALONE)."""

from __future__ import annotations

import contextlib
import json
import os
import uuid

import pytest

from tests.vllm.conftest import PYTHON_ENV, Engines, start_router
from tests.vllm.engines import by_source, failed_transfers
from tests.vllm.turns import Message, chat, opening, reference, session_fields

if not os.environ.get(PYTHON_ENV):
    pytest.skip(
        f"real-vLLM tier: {PYTHON_ENV} is not set (run `make test-vllm`)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(300)
router = contextlib.contextmanager(start_router)


def test_a_turn_on_d_alone_leaves_a_handle_that_p_reads(
    vllm_engines: Engines, redis_url_session: str
) -> None:
    p, d = vllm_engines.p.url, vllm_engines.d.url
    cid = f"alone-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = opening("alone")
    with (
        # The shipped rule: an idle D runs a short later turn alone (the tier's routers pull).
        router(
            vllm_engines, redis_url_session, "vllm-alone", "--decode-local-idle-inflight", "2"
        ) as alone,
        # ... and one that never does: its turn must pull what the first left.
        router(
            vllm_engines, redis_url_session, "vllm-pulls", "--decode-local-max-tokens", "0"
        ) as pulls,
    ):
        answer, reuse, _ = chat(alone, messages, cid=cid)
        assert reuse == "miss;reason=no-session"
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        answer, reuse, _ = chat(alone, messages, cid=cid)
        assert reuse == "hit;via=decode"
        assert answer == reference(vllm_engines, messages)
        _, fields = session_fields(redis_url_session, cid)
        handle = json.loads(fields["kv_transfer_params"])
        assert handle["do_remote_decode"] is True and handle["remote_block_ids"], handle
        assert fields["decode"] == d and fields["no_handle_reason"] == ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Ok?"}]
        pulled, failed = by_source(p, "external_kv_transfer"), failed_transfers(p)
        answer, reuse, _ = chat(pulls, messages, cid=cid)
        assert reuse == "hit", "P read the blocks D kept on the turn it ran alone"
        assert by_source(p, "external_kv_transfer") > pulled
        assert failed_transfers(p) == failed
        assert answer == reference(vllm_engines, messages)
