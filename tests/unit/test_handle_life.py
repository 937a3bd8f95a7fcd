"""A handle's whole life (issue 48), through the fake engines: every handle D gives a turn
ends in the committed state or in a release (a failed save, a lost race, a client that leaves
during the commit, a turn without a conversation), and a handle is read at most once (a
record older than the conversation is a miss, never a read)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from router.turn.capture import Captured
from router.turn.claim import Claim
from router.turn.commit import abort
from router.turn.outcomes import Reason, Reuse
from router.turn.state import Turn
from router.turn.tenant import DEFAULT_TENANT
from sessions.codec import handle_id
from sessions.keys import conversation_key
from sessions.memory_store import MemorySessionStore
from sessions.model import SessionState
from sessions.store import PinNote, StoreError
from tests.unit.fake_engines import FakeEngines
from tests.unit.turns import (
    answer,
    conversation,
    counted,
    expected_answer,
    handle_sent,
    incoming,
    releases,
    releasing,
    second_turn,
    state_of,
    turn,
)

KEY = conversation_key(DEFAULT_TENANT, "c1")


class FailingCommits(MemorySessionStore):
    """A store whose commits fail (`error`), lose (`lost`), land then time out before their
    reply (`lands`: the turn cannot know), or wait for `go` first."""

    def __init__(self) -> None:
        super().__init__()
        self.error = False
        self.lost = False
        self.lands = False
        self.go: asyncio.Event | None = None
        self.started = asyncio.Event()

    async def commit(
        self,
        key: str,
        state: SessionState,
        expected_turn: int,
        ttl_s: float,
        pin: PinNote | None = None,
    ) -> bool:
        self.started.set()
        if self.go is not None:
            await self.go.wait()
        if self.lands:
            await super().commit(key, state, expected_turn, ttl_s, pin)
            raise StoreError("session store commit failed: timed out")
        if self.error:
            raise StoreError("session store commit failed: Redis is over maxmemory")
        if self.lost:
            return False
        return await super().commit(key, state, expected_turn, ttl_s, pin)


async def released_ids(svc: Any, engines: FakeEngines) -> list[str]:
    await svc.releaser.drain()
    return [kv["remote_request_id"] for kv in releases(engines)]


@pytest.mark.parametrize(
    ("fault", "reason"), [("error", "unsaved"), ("lost", "lost-race")], ids=["unsaved", "race"]
)
async def test_a_turn_whose_state_is_not_saved_releases_d_s_new_handle(
    fault: str, reason: str
) -> None:
    engines = FakeEngines()
    store = FailingCommits()
    svc = releasing(engines)
    svc.store = store
    setattr(store, fault, True)
    status, _, body = await turn(svc, second_turn("and then?")[:2], request_id="r0")
    assert status == 200 and answer(body) == expected_answer(second_turn("x")[:2])
    assert len(await released_ids(svc, engines)) == 1, "D's new handle, which nobody stored"
    assert counted(svc, reason) == 1
    assert await svc.store.get(KEY) is None
    await svc.releaser.stop()


@pytest.mark.parametrize("fails", [False, True], ids=["commits", "fails"])
async def test_a_client_that_leaves_during_the_commit_leaves_the_commit_to_finish(
    fails: bool,
) -> None:
    """The commit's outcome decides: stored with D's handle (nothing released), or released."""
    engines = FakeEngines()
    store = FailingCommits()
    svc = releasing(engines)
    svc.store = store
    store.go, store.error = asyncio.Event(), fails
    task = asyncio.create_task(turn(svc, second_turn("and then?")[:2], request_id="r0"))
    await store.started.wait()
    task.cancel()  # the client hangs up while the commit is in flight
    with pytest.raises(asyncio.CancelledError):
        await task
    store.go.set()
    await asyncio.gather(*svc.background)
    stored = await svc.store.get(KEY)
    assert (stored is not None and stored.kv_transfer_params is not None) is not fails
    assert len(await released_ids(svc, engines)) == fails and counted(svc, "unsaved") == fails
    await svc.releaser.stop()


async def test_a_turn_without_a_conversation_releases_d_s_handle() -> None:
    engines = FakeEngines()
    svc = releasing(engines, history_sessions=False)
    status, _, _ = await turn(svc, [{"role": "user", "content": "hello?"}], "r0", cid=None)
    assert status == 200
    assert len(await released_ids(svc, engines)) == 1 and counted(svc, "unkept") == 1
    await svc.releaser.stop()


async def restore(svc: Any, state: SessionState) -> None:
    """Put an older record back, as a restore or a lagging replica would."""
    store = svc.store
    assert isinstance(store, MemorySessionStore)
    store._entries[KEY] = (state, store._entries[KEY][1])


async def test_a_record_restored_after_its_handle_was_read_is_a_miss_never_a_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = FakeEngines()
    svc = releasing(engines)
    await conversation(svc, 1)
    old = await state_of(svc)
    messages = second_turn("and then?")
    _, headers, body = await turn(svc, messages, request_id="r1")
    assert headers["x-kv-reuse"] == "hit"  # turn 2 read turn 1's handle
    await restore(svc, old)
    svc.store._spent.clear()  # type: ignore[attr-defined]  # the router alone remembers it
    with caplog.at_level("WARNING", logger="kvbaton.reuse"):
        _, headers, body = await turn(svc, messages, request_id="r2")
    assert headers["x-kv-reuse"] == "miss;reason=stale-handle"
    assert answer(body) == expected_answer(messages)
    p_legs = [
        c
        for c in engines.calls
        if c.request_id == "r2" and c.url.startswith("http://p") and "/v1/" in c.url
    ]
    assert p_legs and not any(handle_sent(c) for c in p_legs)
    assert "this router read or released it before" in caplog.text
    assert await released_ids(svc, engines) == [], "a spent handle is not released again"
    await svc.releaser.stop()


async def test_the_store_refuses_a_restored_handle_another_replica_read() -> None:
    engines = FakeEngines()
    svc = releasing(engines)
    await conversation(svc, 1)
    old = await state_of(svc)
    messages = second_turn("and then?")
    await turn(svc, messages, request_id="r1")
    await restore(svc, old)
    other = releasing(engines)  # a second replica: nothing in its memory
    other.store = svc.store
    _, headers, body = await turn(other, messages, request_id="r2")
    assert headers["x-kv-reuse"] == "miss;reason=stale-handle"
    assert answer(body) == expected_answer(messages)
    for s in (svc, other):
        await s.releaser.stop()


async def test_a_handle_committed_before_the_store_s_history_broke_is_not_read() -> None:
    engines = FakeEngines()
    svc = releasing(engines)
    await conversation(svc, 1)
    old = await state_of(svc)
    assert svc.clock() > old.updated_at
    svc.store.history_since = svc.clock()  # type: ignore[misc]  # a restart since
    messages = second_turn("and then?")
    _, headers, body = await turn(svc, messages, request_id="r1")
    assert headers["x-kv-reuse"] == "miss;reason=stale-handle"
    assert answer(body) == expected_answer(messages)
    # The next turn's handle is the new history's: read as usual.
    messages = [*messages, {"role": "assistant", "content": answer(body)}]
    _, headers, _ = await turn(svc, [*messages, {"role": "user", "content": "ok?"}], "r2")
    assert headers["x-kv-reuse"] == "hit"
    await svc.releaser.stop()


def test_a_handle_s_digest_is_the_one_the_redis_scripts_compute() -> None:
    import hashlib

    from sessions.codec import to_fields

    state = SessionState(turn=1, kv_transfer_params={"remote_request_id": "x", "n": 1.5})
    stored = to_fields(state)["kv_transfer_params"]
    assert (
        handle_id({"remote_request_id": "x", "n": 1.5})
        == hashlib.sha1(stored.encode(), usedforsecurity=False).hexdigest()
    )


async def test_a_commit_that_timed_out_but_landed_is_spent_in_the_store() -> None:
    """The turn releases D's new handle (unsaved) and, once the store answers, takes it out of
    the state the commit wrote: no replica reads a handle that was released."""
    engines = FakeEngines()
    svc = releasing(engines)
    store = FailingCommits()
    store.lands = True
    svc.store = store
    await turn(svc, second_turn("and then?")[:2], request_id="r0")
    assert len(await released_ids(svc, engines)) == 1 and counted(svc, "unsaved") == 1
    await asyncio.gather(*svc.background)  # the spend, written once the store answers
    state = await state_of(svc)
    assert state.kv_transfer_params is None and state.no_handle_reason == "released"
    await svc.releaser.stop()


@pytest.mark.parametrize("settled", [False, True], ids=["unsettled", "settled"])
async def test_an_abort_releases_d_s_handle_unless_the_turn_settled(settled: bool) -> None:
    """An abort after the turn's end ran (a bad event after D's last one) must not release a
    handle the commit stored."""
    engines = FakeEngines()
    svc = releasing(engines)
    await conversation(svc, 1)
    state = await state_of(svc)
    messages = second_turn("and then?")[:2]
    inc = incoming({"model": "m", "messages": messages, "conversation_id": "c1"})
    claim = Claim(KEY, None, Reuse.miss(Reason.NO_SESSION))
    t = Turn(svc, inc, "r1", claim, time.monotonic())
    t.decode = svc.pool.find("decode", state.decode)
    t.settled = settled
    await abort(t, "decode-malformed", Captured(kv_transfer_params=state.kv_transfer_params))
    assert len(await released_ids(svc, engines)) == (0 if settled else 1)
    await svc.releaser.stop()
