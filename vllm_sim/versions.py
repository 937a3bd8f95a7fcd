"""The vLLM versions the simulator reproduces (`--vllm-version`), and what differs between them
on the wire (reference/vllm-pd-protocol.md §0.1: read from the 0.32.0 and 0.33.0 wheels)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmVersion:
    version: str  # what GET /version answers
    # NixlConnector's NIXL_CONNECTOR_VERSION, part of the handshake's compatibility hash:
    # engines of different versions refuse to handshake with each other.
    connector_version: int
    # vllm#40186: the finish chunk of a stream carries kv_transfer_params, and every content
    # chunk carries "kv_transfer_params": null (set explicitly, so exclude_unset keeps it).
    streams_handles: bool
    # kv_transfer_params carry remote_registration_generation (NIXL connector version 15).
    registration_generation: bool
    # POST /pause (mode abort or wait) refuses new requests with a retryable 503 until /resume.
    pause_rejects: bool


VERSIONS = {
    "0.32": VllmVersion("0.32.0", 14, False, False, False),
    "0.33": VllmVersion("0.33.0", 15, True, True, True),
}
NEWEST = "0.33"
