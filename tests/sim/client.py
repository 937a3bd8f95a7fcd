"""Plain aiohttp helpers for talking to simulator instances in tests."""

from __future__ import annotations

import json
import random
from typing import Any

import aiohttp

from harness import metrics
from vllm_sim.words import COMMON

_TIMEOUT = aiohttp.ClientTimeout(total=20)


def words(seed: int, n: int) -> str:
    """n common words (one vocabulary token each, so n tokens), different per seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(COMMON) for _ in range(n))


async def post(
    url: str, body: Any, headers: dict[str, str] | None = None, raw: bytes | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=_TIMEOUT) as s,
        s.post(url, json=None if raw is not None else body, data=raw, headers=headers) as r,
    ):
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return r.status, text


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=_TIMEOUT) as s, s.get(url) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return r.status, text


def parse_sse(raw: bytes) -> list[Any]:
    """`data:` events in order; `[DONE]` stays the string "[DONE]"."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession(timeout=_TIMEOUT) as s,
        s.post(url, json=body, headers=headers) as r,
    ):
        return r.status, await r.read()


async def chat(
    base: str, messages: list[dict[str, Any]], **extra: Any
) -> tuple[int, dict[str, Any]]:
    status, body = await post(base + "/v1/chat/completions", {"messages": messages, **extra})
    return status, body


async def metric(base: str, name: str, **labels: str) -> float:
    """A sample's value from /metrics (summed over those with `labels`; KeyError if none)."""
    _, text = await get(base + "/metrics")
    found = metrics.matching(text, name, **labels)
    if not found:
        raise KeyError(f"{name} {labels} not in /metrics")
    return sum(s.value for s in found)


async def external(base: str) -> float:
    return await metric(base, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


async def tokenize(base: str, messages: list[dict[str, Any]]) -> list[int]:
    status, body = await post(
        base + "/tokenize", {"messages": messages, "add_generation_prompt": True}
    )
    assert status == 200, body
    return list(body["tokens"])


def parse_events(raw: bytes) -> list[dict[str, Any]]:
    """Named SSE events (`event: T` + `data: {...}`, the Responses API); checks T == data.type."""
    events: list[dict[str, Any]] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :], block
        events.append(event)
    return events


def output_text(response: dict[str, Any]) -> str:
    """The text of a Responses API object's message items."""
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
