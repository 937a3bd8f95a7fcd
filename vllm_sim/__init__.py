"""vllm_sim: a vLLM-compatible prefill/decode engine simulator with NixlConnector semantics."""
