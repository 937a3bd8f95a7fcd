"""Client body -> prefill (P) body and decode (D) body. Pure: the arguments are never mutated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Consumed by the router and never forwarded (as vLLM's disagg_proxy_multiturn.py does).
ROUTER_FIELDS = ("conversation_id",)
KV_FIELD = "kv_transfer_params"
_APIS = ("chat", "completions", "responses")
# vLLM rejects these on a max_tokens=1, stream=false request ("not supported for P"):
# stream_options without stream=true is a 400, min_tokens > max_tokens too.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def split_client_body(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The body to forward, and the raw (unvalidated) conversation_id or None.

    A client's own kv_transfer_params are dropped: they name blocks on our engines, so
    trusting them would let a client read or pin another tenant's KV.
    """
    forward = {k: v for k, v in body.items() if k not in ROUTER_FIELDS and k != KV_FIELD}
    return forward, body.get("conversation_id")


def prefill_body(
    body: Mapping[str, Any], kv_params: Mapping[str, Any], *, api: str
) -> dict[str, Any]:
    """The P leg: one token, not streamed, carrying `kv_params` (a D handle or the null handoff)."""
    if api not in _APIS:
        raise ValueError(f"unknown api {api!r}; expected one of {_APIS}")
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["stream"] = False
    if api == "responses":
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    out[KV_FIELD] = dict(kv_params)
    return out


def decode_body(
    body: Mapping[str, Any], kv_params: Mapping[str, Any] | None, *, return_token_ids: bool
) -> dict[str, Any]:
    """The D leg: the client's own body (stream, limits) plus P's params when P returned any."""
    out = dict(body)
    if kv_params is None:
        # No params from P: D prefills locally. Never forward a P-leg dict (vLLM's
        # disagg_proxy_multiturn.py does, and D then reads D's own blocks).
        out.pop(KV_FIELD, None)
    else:
        out[KV_FIELD] = dict(kv_params)
    if return_token_ids:
        out["return_token_ids"] = True
    return out


def client_wants_token_ids(body: Mapping[str, Any]) -> bool:
    return body.get("return_token_ids") is True
