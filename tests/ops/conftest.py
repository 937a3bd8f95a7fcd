"""Ops fixtures: simulator P/D processes, routers with an admin key, a private Redis database."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from harness.chat import CHAT, JSON, chat_body, post
from harness.procs import SimProc, log_file, sim
from harness.router import RouterProc, router

ADMIN_KEY = "ops-admin-key"
BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")
# The ops tests keep their registry and conversations in their own Redis database, so that
# the kvbaton:instances entries they write never reach the routers of other test modules.
OPS_DB = 7


def call(
    method: str, url: str, body: Any = None, *, key: str | None = ADMIN_KEY, timeout: float = 10
) -> tuple[int, Any]:
    """One HTTP call; returns (status, decoded JSON body)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def chat(
    router_url: str, cid: str, content: str, *, max_tokens: int = 8, bearer: str = ""
) -> tuple[int, str]:
    """One non-streaming chat turn of conversation cid; returns (status, X-KV-Reuse); an
    error status is returned too."""
    body = chat_body([{"role": "user", "content": content}], cid=cid, max_tokens=max_tokens)
    headers = dict(JSON)
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    reply = post(router_url + CHAT, body, headers=headers, timeout=20)
    return reply.status, reply.reuse


def log_path(tag: str) -> Path:
    """The log file of the router ops_router(tag=tag) started (spawn() writes it)."""
    return log_file(f"ops-{tag}")


def decode_urls(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {i["url"]: i for i in status["instances"]["decode"]}


@contextlib.contextmanager
def ops_router(
    p: SimProc, decodes: list[SimProc], *args: str, redis_url: str | None, tag: str
) -> Iterator[RouterProc]:
    """A router process with the admin API on and a fast registry re-read."""
    name = f"ops-{tag}"
    extra = ("--admin-key", ADMIN_KEY, "--health-interval", "0.3", *args)
    with router([p.url], [d.url for d in decodes], *extra, redis_url=redis_url, name=name) as r:
        yield r


@pytest.fixture(scope="module")
def p() -> Iterator[SimProc]:
    with sim("prefill", *BIDIR, name="ops-p") as proc:
        yield proc


@pytest.fixture(scope="module")
def d() -> Iterator[SimProc]:
    with sim("decode", *BIDIR, name="ops-d") as proc:
        yield proc


@pytest.fixture(scope="module")
def d2() -> Iterator[SimProc]:
    with sim("decode", *BIDIR, name="ops-d2") as proc:
        yield proc


@pytest.fixture(scope="module")
def ops_redis(redis_url_session: str) -> Iterator[str]:
    """The session's redis-server, database OPS_DB, emptied before and after each module."""
    url = redis_url_session.rsplit("/", 1)[0] + f"/{OPS_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()
