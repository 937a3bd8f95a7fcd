"""A handle's whole life under faults and races (issue 48), on simulators behind two router
replicas sharing one Redis: every pin D makes for a turn ends in a committed state or in a
release (0 orphans: D's pins that no stored state names), and a handle is read at most once
(a record older than the conversation is a miss with the right answer, never a read)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from harness.chat import chat_body, get_json, post
from harness.metrics import metric
from harness.procs import restart_redis, stop, wait_until
from harness.stack import Stack, start_stack
from sessions.keys import CONVERSATION_PATTERN, conversation_key
from tests.reliability.helpers import (
    Conversation,
    clear_faults,
    faults,
    new_cid,
    reference,
    router,
    running,
)

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")
# D takes 20 ms a token: a turn is in flight long enough to be cut by a SIGTERM.
D_FLAGS = (*BIDIR, "--stream-kv-params", "--decode-ms-per-token", "20")
SECRET = "handle-life-session-secret-0001"
FLAGS = (
    "--release-after",
    "900",  # nothing goes idle-released during a test: every release here is the turn's own
    "--session-secret",
    SECRET,
    "--stream-kv-params",
    "--health-interval",
    "0.3",
    "--store-retry-after",
    "0.5",
    "--shutdown-grace",
    "10",
)


@pytest.fixture(scope="module")
def st() -> Iterator[Stack]:
    with start_stack(
        prefill=[BIDIR],
        decode=[D_FLAGS],
        reference=(),
        routers=[FLAGS, FLAGS],
        name="life",
        router_timeout=60,
        router_attempts=2,
    ) as s:
        yield s


@pytest.fixture
def rdb(st: Stack) -> Iterator[redis.Redis]:
    assert st.redis_url is not None
    client = redis.Redis.from_url(st.redis_url, decode_responses=True)
    yield client
    client.close()


def d_pins(st: Stack) -> set[str]:
    """D's request ids whose blocks it pins for a reader."""
    pins = get_json(st.d.url + "/sim/state")["pins"]
    return {p["request_id"] for p in pins if p["kind"] == "decoder"}


def stored_handles(rdb: redis.Redis) -> set[str]:
    """The D request ids the stored states' handles name."""
    ids = set()
    for key in rdb.scan_iter(CONVERSATION_PATTERN, count=500):
        params = rdb.hget(key, "kv_transfer_params")
        if params and params != "null":
            ids.add(json.loads(params)["remote_request_id"])
    return ids


def orphans(st: Stack, rdb: redis.Redis) -> set[str]:
    """D's pins that no stored state names: nobody would ever read or release them."""
    return d_pins(st) - stored_handles(rdb)


def no_new_orphans(st: Stack, rdb: redis.Redis, before: set[str]) -> None:
    """No orphan but those of `before` (a restore loses the handles committed after its
    snapshot: D's TTL alone frees those), once the releases the turns queued went out."""
    wait_until(lambda: not orphans(st, rdb) - before, f"orphans: {orphans(st, rdb) - before}")


def turn_copies(st: Stack, conv: Conversation, copies: int) -> list[str]:
    """The conversation's next question sent `copies` times at once, spread over the router
    replicas; every answer right; the conversation goes on with it. The verdicts."""
    conv.turns += 1
    conv.messages.append(
        {"role": "user", "content": f"Question {conv.turns} ({conv.nonce}): tea or rain?"}
    )
    body = chat_body(conv.messages, cid=conv.cid, max_tokens=6)
    urls = [st.routers[i % len(st.routers)].url for i in range(copies)]
    with ThreadPoolExecutor(copies) as pool:
        replies = list(pool.map(lambda u: post(u + "/v1/chat/completions", body), urls))
    expected = reference(st.ref, conv.messages, 6)
    for reply in replies:
        assert reply.status == 200, reply.body[:300]
        assert reply.answer() == expected, reply.reuse
    conv.messages.append({"role": "assistant", "content": expected})
    return [r.reuse for r in replies]


def released(st: Stack, reason: str) -> float:
    return sum(
        metric(r.url, "kvbaton_pin_releases_total", reason=reason, outcome="released")
        for r in st.routers
    )


@pytest.mark.timeout(120)
def test_four_copies_of_every_turn_on_two_replicas_leave_no_orphans(
    st: Stack, rdb: redis.Redis
) -> None:
    before = orphans(st, rdb)
    convs = [Conversation(st.url, st.ref, new_cid("dup")) for _ in range(5)]
    verdicts = [turn_copies(st, c, 4) for _ in range(3) for c in convs]
    assert any("hit" in v for v in verdicts), verdicts  # the copies raced for real handles
    no_new_orphans(st, rdb, before)
    assert released(st, "lost-race") > 0


@pytest.mark.timeout(120)
def test_a_store_over_maxmemory_leaves_no_orphans(st: Stack, rdb: redis.Redis) -> None:
    before = orphans(st, rdb)
    going = [Conversation(st.routers[i % 2].url, st.ref, new_cid("oom")) for i in range(4)]
    for conv in going:
        conv.turn()
    rdb.config_set("maxmemory-policy", "noeviction")
    rdb.config_set("maxmemory", "1")  # every write fails: claims and commits
    try:
        fresh = [Conversation(st.routers[i % 2].url, st.ref, new_cid("oom")) for i in range(4)]
        for conv in [*going, *fresh]:
            assert conv.turn().reuse.startswith("miss")  # answered, without the store
    finally:
        rdb.config_set("maxmemory", "0")
    no_new_orphans(st, rdb, before)
    for conv in going:  # their handles from before the fault are still theirs
        conv.turn()


def test_a_record_restored_by_dump_restore_is_a_miss_on_every_replica(
    st: Stack, rdb: redis.Redis
) -> None:
    first, second = st.routers[0].url, st.routers[1].url
    conv = Conversation(first, st.ref, new_cid("restore"))
    conv.turn()
    key = conversation_key("default", conv.cid or "")
    old = rdb.dump(key)
    assert old is not None
    assert conv.turn().reuse == "hit"  # turn 2 read turn 1's handle: D freed its blocks
    rdb.restore(key, 0, old, replace=True)  # turn 1's record, signed, with that handle
    conv.router = second  # a replica that never saw the handle read
    reply = conv.turn()  # the answer is checked against the reference
    assert reply.reuse == "miss;reason=stale-handle"
    assert "its stored handle is not read" in st.routers[1].log.read_text()
    assert conv.turn().reuse == "hit"  # its own next handle is read as usual
    rdb.restore(key, 0, old, replace=True)
    conv.router = first
    assert conv.turn().reuse == "miss;reason=stale-handle"
    # Another tenant whose prompt shares the whole prefix: P's cache holds nothing wrong.
    other = Conversation(second, st.ref, new_cid("tenant"), messages=conv.messages[:-2])
    other.headers["authorization"] = "Bearer another-tenant"
    other.turns, other.nonce = conv.turns - 1, conv.nonce
    other.turn()  # the oracle's answer


def test_redis_restored_from_an_older_snapshot_reads_no_handle_of_before(
    st: Stack, rdb: redis.Redis
) -> None:
    """A restore from a backup brings back the conversation's record and its spent keys as
    they were: only the store's new run id tells; a replica that read nothing knows no more."""
    assert st.redis_port is not None and st.redis_proc is not None
    first, second = st.routers[0].url, st.routers[1].url
    conv = Conversation(first, st.ref, new_cid("snapshot"))
    conv.turn()
    directory = rdb.config_get("dir")["dir"]
    rdb.save()
    backup = tempfile.mkdtemp()
    shutil.copy(os.path.join(directory, "dump.rdb"), backup)
    assert conv.turn().reuse == "hit"  # turn 2 read turn 1's handle after the snapshot
    stop(st.redis_proc)
    shutil.copy(os.path.join(backup, "dump.rdb"), directory)
    shutil.rmtree(backup)
    st.redis_proc = restart_redis(st.redis_port, directory)
    conv.router = second
    verdicts = [conv.turn().reuse]
    while verdicts[-1] == "miss;reason=store-unavailable":  # the replica reconnecting
        verdicts.append(conv.turn().reuse)
    assert verdicts[-1] == "miss;reason=stale-handle", verdicts
    assert conv.turn().reuse == "hit"


@pytest.mark.timeout(120)
def test_a_router_stopped_by_sigterm_mid_turn_leaves_no_orphans(
    st: Stack, rdb: redis.Redis
) -> None:
    """Turns in flight when SIGTERM comes finish (the grace), and the handles they leave for
    release (edited histories: the one each took and P did not read) are released before the
    process exits, though P is slow to take them."""
    before = orphans(st, rdb)
    assert st.redis_url is not None
    with router([st.p.url], [st.d.url], *FLAGS, redis_url=st.redis_url, name="life-term") as r:
        convs = [Conversation(r.url, st.ref, new_cid("term")) for _ in range(3)]
        for conv in convs:
            conv.turn()
        edited = [
            [{"role": "user", "content": f"Edited ({c.nonce})?"}, *c.messages[1:]] for c in convs
        ]
        bodies = [
            chat_body(m, cid=c.cid, max_tokens=40) for m, c in zip(edited, convs, strict=True)
        ]
        with ThreadPoolExecutor(len(bodies)) as pool:
            sent = [pool.submit(post, r.url + "/v1/chat/completions", b) for b in bodies]
            wait_until(lambda: running(st.d) >= len(bodies), "every turn decoding on D")
            faults(st.p, stall_next=len(bodies), stall_s=1.5)  # the releases wait on P
            r.proc.send_signal(signal.SIGTERM)
            replies = [future.result() for future in sent]
        assert [x.reuse for x in replies] == ["miss;reason=prefix-mismatch"] * len(bodies)
        assert r.proc.wait(30) == 0
    clear_faults(st.p)
    no_new_orphans(st, rdb, before)
