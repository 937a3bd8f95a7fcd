"""A handle older than --handle-ttl is not used (miss;reason=expired), while the session's
affinity and digests live on for --session-ttl; reuse resumes with the next fresh handle."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness.router import RouterProc
from tests.reliability.conftest import ENGINE_KEY, Stack
from tests.reliability.helpers import Conversation, new_cid, router, session

HANDLE_TTL = 1.0
LONG_HANDLE_TTL = 60.0


def ttl_router(stack: Stack, handle_ttl: float, name: str) -> Iterator[RouterProc]:
    """A second router on the shared engines and Redis whose handles live handle_ttl s."""
    # --no-release-pins: the release delay is capped at --handle-ttl, so a release would race
    # the expiry these tests observe (released handles say miss;reason=released instead).
    args = ("--stream-kv-params", "--handle-ttl", str(handle_ttl), "--session-ttl", "120")
    args += ("--no-release-pins",)
    args += ("--engine-api-key", ENGINE_KEY)
    ps, ds = [p.url for p in stack.ps], [d.url for d in stack.ds]
    with router(ps, ds, *args, redis_url=stack.redis_url, name=name) as r:
        yield r


@pytest.fixture(scope="module")
def short_ttl(stack: Stack) -> Iterator[RouterProc]:
    yield from ttl_router(stack, HANDLE_TTL, "rel-ttl-router")


@pytest.fixture(scope="module")
def long_ttl(stack: Stack) -> Iterator[RouterProc]:
    """The same router but for handles that live a minute: a turn through it is not at the
    mercy of a machine that stalls for a second."""
    yield from ttl_router(stack, LONG_HANDLE_TTL, "rel-long-ttl-router")


def test_handle_older_than_the_ttl_is_a_miss(
    main: Stack, short_ttl: RouterProc, long_ttl: RouterProc
) -> None:
    conv = Conversation(short_ttl.url, main.ref, new_cid("ttl"))
    assert conv.turn().reuse == "miss;reason=no-session"
    fields = session(main.redis_url, str(conv.cid))
    assert float(fields["handle_expires_at"]) - time.time() <= HANDLE_TTL + 0.1
    time.sleep(HANDLE_TTL + 0.5)
    # Expiry is the committed handle's own (handle_expires_at), whichever router reads it:
    # through the long-TTL router the stale handle is still a miss, and the handle that
    # turn commits lives a minute, so the next turn hits.
    conv.router = long_ttl.url
    assert conv.turn().reuse == "miss;reason=expired"  # and the oracle's answer
    fields = session(main.redis_url, str(conv.cid))
    assert fields["turn"] == "2"
    assert float(fields["handle_expires_at"]) - time.time() > HANDLE_TTL + 0.1
    assert conv.turn().reuse == "hit"
