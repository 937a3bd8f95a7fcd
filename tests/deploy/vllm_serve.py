"""What the deploy files (compose and Kubernetes) may ask of `vllm serve`: its flags and the
bidirectional NIXL config of the GPU profiles."""

from __future__ import annotations

# `vllm serve` flags the GPU profile may use (vLLM 0.32; the engine is not installed here).
VLLM_FLAGS = {
    "--host", "--port", "--served-model-name", "--max-model-len", "--block-size",
    "--gpu-memory-utilization", "--enforce-eager", "--enable-prompt-tokens-details",
    "--kv-transfer-config", "--api-key", "--enable-request-id-headers", "--enable-scale-out",
}  # fmt: skip
BIDIR_NIXL = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
}
