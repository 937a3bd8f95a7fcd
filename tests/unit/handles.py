"""Handles (D's kv_transfer_params) that several unit test files read."""

from __future__ import annotations

from typing import Any

# A small handle as a state stores it: three blocks on D's side channel at 127.0.0.1:5600.
HANDLE: dict[str, Any] = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "d-engine",
    "remote_request_id": "req",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_num_tokens": 10,
}

# D's own handle as vLLM 0.32 returns it (vllm-cpu README section 4, bidirectional).
D_HANDLE: dict[str, Any] = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]],
    "remote_engine_id": "da455c08",
    "remote_request_id": "cmpl-a02558b8459e7e61-0-a2b83774",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 299,
    "remote_blocks_expiry_time": 2095.3,
    "transfer_mode": "pull",
}
