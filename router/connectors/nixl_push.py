"""NixlPushConnector (push/WRITE mode, vLLM's `disagg_proxy_pushconnector_demo.py`) behind the
connector seam. P and D are called concurrently (router/turn/push.py): P gets the null handoff
with a fresh `transfer_id`, D gets P's coordinates (router/engines/coords.py) and the same
transfer id, and D registers its blocks with P, which writes into them.

vLLM refuses bidirectional transfer for push (vllm#46473), so there is no handle to keep: a
conversation gets affinity (same P, same D) and nothing is read from D on the next turn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.connectors import nixl


class NixlPush:
    name = "nixl-push"

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        # Never a handle (no D->P reads in push mode); push.py adds the transfer id.
        return nixl.miss_params()

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        # push.py hands D's params (P's coordinates and the transfer id) through as they are.
        return dict(prefilled) if prefilled is not None else None

    def truncate(
        self, params: Mapping[str, Any], num_tokens: int, block_size: int
    ) -> dict[str, Any]:
        raise ValueError("push mode keeps no handle to truncate")

    def is_handle(self, params: object) -> bool:
        return False  # what D returns is never read back by P in push mode

    def engine_id(self, params: Mapping[str, Any]) -> str | None:
        return nixl.engine_id(params)

    def prefill_failed(self, status: int, body: Mapping[str, Any] | None) -> bool:
        return nixl.prefill_failed(status, body)
