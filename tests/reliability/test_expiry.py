"""A handle older than --handle-ttl is not used (miss;reason=expired), while the session's
affinity and digests live on for --session-ttl; reuse resumes with the next fresh handle."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.reliability.conftest import ENGINE_KEY, Stack
from tests.reliability.helpers import Conversation, new_cid, router, session
from tests.support.router import RouterProc

HANDLE_TTL = 1.0


@pytest.fixture(scope="module")
def short_ttl(stack: Stack) -> Iterator[RouterProc]:
    """A second router on the shared engines and Redis whose handles live one second."""
    args = ("--stream-kv-params", "--handle-ttl", str(HANDLE_TTL), "--session-ttl", "60")
    args += ("--engine-api-key", ENGINE_KEY)
    ps, ds = [p.url for p in stack.ps], [d.url for d in stack.ds]
    with router(ps, ds, *args, redis_url=stack.redis_url, name="rel-ttl-router") as r:
        yield r


def test_handle_older_than_the_ttl_is_a_miss(main: Stack, short_ttl: RouterProc) -> None:
    conv = Conversation(short_ttl.url, main.ref, new_cid("ttl"))
    assert conv.turn().reuse == "miss;reason=no-session"
    time.sleep(HANDLE_TTL + 0.5)
    assert conv.turn().reuse == "miss;reason=expired"  # and the oracle's answer
    fields = session(main.redis_url, str(conv.cid))
    assert fields["turn"] == "2"
    assert float(fields["handle_expires_at"]) - time.time() <= HANDLE_TTL + 0.1
    reply = conv.turn()
    assert reply.reuse in ("hit", "miss;reason=expired")  # hit unless this machine stalled 1 s
