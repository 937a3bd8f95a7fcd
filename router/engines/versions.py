"""What an engine's vLLM version means for the router, from its own `GET /version`: whether it
streams D's handle, its NIXL connector version (engines of different connector versions
refuse to handshake), whether a pause refuses requests with 503, and whether its handles carry
a registration generation. Pure (reference/vllm-pd-protocol.md §0.1: read from the wheels)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

_RELEASE = re.compile(r"^v?(\d+)\.(\d+)")
# NixlConnector's NIXL_CONNECTOR_VERSION by vLLM release (metadata.py in each wheel).
CONNECTOR_VERSIONS = {(0, 32): 14, (0, 33): 15}
NEWEST_KNOWN = max(CONNECTOR_VERSIONS)
# vllm#51919 (open): where a D parked by concurrent dispatch gets P's params; served or not is
# learned per engine (lifecycle/health.py), as no release has it yet.
READY_PATH = "/v1/pd_kv_ready"


@dataclass(frozen=True)
class EngineVersion:
    """One engine's version and what follows from it ("" : not known, as before /version
    answered: then nothing is assumed and it pairs with every engine)."""

    version: str = ""

    # Read on every placement (each candidate's group): computed once per version (a frozen
    # dataclass's cached_property writes the instance's __dict__, not its fields).
    @cached_property
    def release(self) -> tuple[int, int] | None:
        match = _RELEASE.match(self.version)
        return (int(match.group(1)), int(match.group(2))) if match else None

    def _at_least(self, release: tuple[int, int]) -> bool:
        mine = self.release
        return mine is not None and mine >= release

    @property
    def streams_handles(self) -> bool:
        """vllm#40186 (0.33): the finish chunk of a stream carries kv_transfer_params."""
        return self._at_least((0, 33))

    @property
    def pause_rejects(self) -> bool:
        """0.33: a paused engine answers new requests 503 (engine_paused) instead of queueing."""
        return self._at_least((0, 33))

    @property
    def registration_generation(self) -> bool:
        """0.33 (connector version 15): handles carry remote_registration_generation."""
        return self._at_least((0, 33))

    @cached_property
    def connector_version(self) -> int | None:
        release = self.release
        return CONNECTOR_VERSIONS.get(release) if release is not None else None

    @cached_property
    def group(self) -> str:
        """Engines that can move KV to each other share a group ("": not known, pairs with
        any): the NIXL connector version where known, else the release (a newer vLLM than
        this router knows is assumed to talk only to its own release)."""
        if self.connector_version is not None:
            return f"nixl-v{self.connector_version}"
        release = self.release
        return f"vllm-{release[0]}.{release[1]}" if release is not None else ""

    def pairs_with(self, other: EngineVersion) -> bool:
        return not self.group or not other.group or self.group == other.group


def parse(body: object) -> str:
    """The version string of a /version answer ({"version": "0.33.0"}); "" if none."""
    if isinstance(body, Mapping):
        value = body.get("version")
        if isinstance(value, str) and len(value) <= 64:
            return value
    return ""


def registration_generation(params: Mapping[str, Any] | None) -> int:
    """The registration generation a handle names (vLLM 0.33; absent, as 0.32's: 0)."""
    value = (params or {}).get("remote_registration_generation")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def engine_paused(status: int, body: Mapping[str, Any] | None) -> bool:
    """vLLM 0.33's refusal of a new request while paused: 503 ServiceUnavailableError (the
    engine's RequestError code `engine_paused`; its OpenAI layer answers `code` 503)."""
    if status != 503 or body is None:
        return False
    error = body.get("error")
    if not isinstance(error, Mapping):
        return False
    message = error.get("message")
    return (
        error.get("code") == "engine_paused"
        or error.get("type") == "ServiceUnavailableError"
        or (isinstance(message, str) and "paused" in message.lower())
    )
