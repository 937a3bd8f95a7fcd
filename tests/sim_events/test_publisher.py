"""KVEventPublisher against real ZMQ SUB, DEALER and REQ sockets on loopback."""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from harness.procs import free_port
from vllm_sim.events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from vllm_sim.events_decode import decode_batch

Frames = list[bytes]
SYNC_HASH = 2**64 - 2


class Sockets:
    """Client sockets for one test, all closed at teardown (pyzmq warns on unclosed ones)."""

    def __init__(self) -> None:
        self.context: zmq.Context[Any] = zmq.Context()
        self.made: list[zmq.Socket[Any]] = []

    def socket(self, kind: int) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self.context.socket(kind)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.made:
            sock.close(linger=0)
        self.context.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


@pytest.fixture
def pub() -> Iterator[KVEventPublisher]:
    publisher = KVEventPublisher(0, 0, clock=lambda: 1234.5)
    publisher.start()
    yield publisher
    publisher.close()


def subscribe(ctx: Sockets, pub: KVEventPublisher, topic: bytes = b"") -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    return sub


def sync(sub: zmq.Socket[Any], pub: KVEventPublisher) -> int:
    """Beat the slow joiner: probe until one batch arrives, then drain to a marker; its seq."""
    for i in itertools.count():
        pub.publish([BlockRemoved([i])])
        if sub.poll(20):
            break
    pub.publish([BlockRemoved([SYNC_HASH])])
    while True:
        _topic, seq, payload = sub.recv_multipart()
        if decode_batch(payload)[1][0]["block_hashes"] == [SYNC_HASH]:
            return int.from_bytes(seq, "big")


def replay(ctx: Sockets, pub: KVEventPublisher, start: int, *, delim: bool) -> list[Frames]:
    """Ask the ROUTER for batches from start; every reply message up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
    head = [b""] if delim else []
    dealer.send_multipart([*head, start.to_bytes(8, "big")])
    replies = []
    while True:
        frames = dealer.recv_multipart()
        assert frames[: len(head)] == head
        replies.append(frames[len(head) :])
        if frames[-2] == END_OF_REPLAY:
            return replies


def seqs(replies: list[Frames]) -> list[int]:
    return [int.from_bytes(r[0], "big", signed=True) for r in replies]


def test_wire_shape_is_vllm_0_32(ctx: Sockets) -> None:
    with KVEventPublisher(0, None, topic="kv@p", data_parallel_rank=3, clock=lambda: 9.5) as pub:
        sub = subscribe(ctx, pub)
        first = sync(sub, pub)
        pub.publish([BlockStored([2**63 + 1, 5], None, [1, 2, 3, 4], 2), BlockRemoved([7])])
        pub.publish([AllBlocksCleared()])
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@p"
        assert seq == (first + 1).to_bytes(8, "big")
        assert msgspec.msgpack.decode(payload) == [
            9.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [2**63 + 1, 5],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None, None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            ],
            3,
        ]
        assert sub.recv_multipart() == [
            b"kv@p",
            (first + 2).to_bytes(8, "big"),
            msgspec.msgpack.encode([9.5, [{"type": "AllBlocksCleared"}], 3]),
        ]


def test_seq_starts_at_zero(ctx: Sockets, pub: KVEventPublisher) -> None:
    sub = subscribe(ctx, pub)
    for i in itertools.count():  # the first probe that gets through is not always seq 0
        pub.publish([BlockRemoved([i])])
        if sub.poll(20):
            break
    assert seqs(replay(ctx, pub, 0, delim=True))[0] == 0


def test_batches_in_order_with_consecutive_seqs(ctx: Sockets, pub: KVEventPublisher) -> None:
    sub = subscribe(ctx, pub)
    first = sync(sub, pub)
    hashes = [2**64 - 1 - i for i in range(100)]  # all above 2**63
    for h in hashes:
        pub.publish([BlockStored([h], h - 1, [0, 1], 2)])
    got = [sub.recv_multipart() for _ in hashes]
    assert [int.from_bytes(f[1], "big") for f in got] == list(range(first + 1, first + 101))
    events = [decode_batch(f[2])[1][0] for f in got]
    assert [(e["block_hashes"], e["parent_block_hash"]) for e in events] == [
        ([h], h - 1) for h in hashes
    ]


def test_empty_publish_sends_nothing(ctx: Sockets, pub: KVEventPublisher) -> None:
    sub = subscribe(ctx, pub)
    first = sync(sub, pub)
    pub.publish([])
    pub.publish([AllBlocksCleared()])
    assert sub.recv_multipart()[1] == (first + 1).to_bytes(8, "big")


def test_replay_fills_late_subscriber_gap(ctx: Sockets, pub: KVEventPublisher) -> None:
    for i in range(5):
        pub.publish([BlockRemoved([2**63 + i])])  # nobody subscribed yet: lost on the live stream
    sub = subscribe(ctx, pub)
    marker = sync(sub, pub)
    replies = replay(ctx, pub, 0, delim=True)
    assert seqs(replies) == [*range(marker + 1), -1]
    assert replies[-1] == [END_OF_REPLAY, b""]
    assert [decode_batch(p)[1] for _s, p in replies[:5]] == [
        [{"type": "BlockRemoved", "block_hashes": [2**63 + i], "medium": "GPU", "group_idx": 0}]
        for i in range(5)
    ]


def test_replay_returns_exactly_the_dropped_batches(ctx: Sockets, pub: KVEventPublisher) -> None:
    sub = subscribe(ctx, pub)
    first = sync(sub, pub)
    for i in range(6):
        pub.publish([BlockRemoved([i])])
    live = [sub.recv_multipart() for _ in range(6)]
    kept = [f for f in live if int.from_bytes(f[1], "big") < first + 4]  # drop the last 3
    missing = int.from_bytes(kept[-1][1], "big") + 1
    replies = replay(ctx, pub, missing, delim=True)
    assert replies[:-1] == [[f[1], f[2]] for f in live[3:]]
    assert seqs(replies) == [first + 4, first + 5, first + 6, -1]


def test_a_replay_request_without_the_delimiter_is_not_answered(
    ctx: Sockets, pub: KVEventPublisher
) -> None:
    """vLLM's _service_replay unpacks (identity, delimiter, start): a DEALER that sends the
    start alone gets no answer (vLLM logs "Invalid replay request"), so the simulator neither."""
    pub.publish([AllBlocksCleared()])
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
    dealer.send_multipart([(0).to_bytes(8, "big")])
    assert not dealer.poll(500)
    assert replay(ctx, pub, 0, delim=True)[-1] == [END_OF_REPLAY, b""]  # still serving


def test_replay_past_the_end_or_a_short_start_gets_only_the_end_marker(
    ctx: Sockets, pub: KVEventPublisher
) -> None:
    pub.publish([AllBlocksCleared()])
    assert replay(ctx, pub, 10**6, delim=True) == [[END_OF_REPLAY, b""]]
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
    dealer.send_multipart([b"", b"\x00\x01"])
    assert dealer.recv_multipart() == [b"", END_OF_REPLAY, b""]


def test_replay_on_empty_buffer(ctx: Sockets, pub: KVEventPublisher) -> None:
    assert replay(ctx, pub, 0, delim=True) == [[END_OF_REPLAY, b""]]


def test_req_client_gets_the_first_replayed_batch(ctx: Sockets, pub: KVEventPublisher) -> None:
    # One reply message per batch, as vLLM: a REQ socket reads only the first; use DEALER.
    pub.publish([AllBlocksCleared()])
    pub.publish([AllBlocksCleared()])
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{pub.replay_port}")
    req.send((0).to_bytes(8, "big"))
    seq, payload = req.recv_multipart()
    assert seq == (0).to_bytes(8, "big")
    assert decode_batch(payload) == (1234.5, [{"type": "AllBlocksCleared"}], 0)


def test_replay_buffer_holds_the_last_buffer_steps(ctx: Sockets) -> None:
    with KVEventPublisher(0, 0, buffer_steps=5) as pub:
        for i in range(12):
            pub.publish([BlockRemoved([i])])
        replies = replay(ctx, pub, 0, delim=True)
        assert seqs(replies) == [7, 8, 9, 10, 11, -1]
        assert [decode_batch(p)[1][0]["block_hashes"] for _s, p in replies[:-1]] == [
            [i] for i in range(7, 12)
        ]
        assert seqs(replay(ctx, pub, 10, delim=True)) == [10, 11, -1]


def test_publish_from_several_threads(ctx: Sockets, pub: KVEventPublisher) -> None:
    sub = subscribe(ctx, pub)
    first = sync(sub, pub)
    n_threads, per_thread = 8, 50
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            pub.publish([BlockRemoved([t, i])])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = [sub.recv_multipart() for _ in range(n_threads * per_thread)]
    total = n_threads * per_thread
    assert [int.from_bytes(f[1], "big") for f in got] == list(range(first + 1, first + 1 + total))
    pairs = [decode_batch(f[2])[1][0]["block_hashes"] for f in got]
    for t in range(n_threads):
        assert [i for tt, i in pairs if tt == t] == list(range(per_thread))  # per-thread order


def test_close_is_clean_and_idempotent() -> None:
    before = threading.active_count()
    pub = KVEventPublisher(0, 0)
    pub.start()
    port, replay_port = pub.port, pub.replay_port
    assert isinstance(port, int) and isinstance(replay_port, int)
    pub.publish([AllBlocksCleared()])
    pub.close()
    pub.close()
    pub.publish([AllBlocksCleared()])  # after close: dropped silently
    assert threading.active_count() == before
    with KVEventPublisher(port, replay_port) as again:  # the ports were released
        assert (again.port, again.replay_port) == (port, replay_port)


def test_close_before_start() -> None:
    pub = KVEventPublisher(0, 0)
    pub.close()
    with pytest.raises(RuntimeError):
        pub.start()


def test_disabled_when_port_is_none() -> None:
    with KVEventPublisher(None, free_port()) as pub:
        pub.publish([AllBlocksCleared()])
        assert pub.port is None


def test_explicit_ports_and_misuse() -> None:
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(port, replay_port)
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])
    pub.start()
    try:
        assert (pub.port, pub.replay_port) == (port, replay_port)
        with pytest.raises(RuntimeError):
            pub.start()
    finally:
        pub.close()


def test_bind_error_surfaces_in_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        pub = KVEventPublisher(0, busy)
        with pytest.raises(zmq.ZMQError):
            pub.start()
        pub.close()


def test_full_queue_drops_and_counts(
    pub: KVEventPublisher, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(item: object) -> None:
        raise queue.Full

    monkeypatch.setattr(pub._queue, "put_nowait", full)
    with caplog.at_level(logging.WARNING, logger="vllm_sim.events"):
        pub.publish([AllBlocksCleared()])
    assert pub.dropped == 1
    assert "dropped" in caplog.text


def test_ipv6_loopback(ctx: Sockets) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with KVEventPublisher(0, 0, host="::1") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://[::1]:{pub.port}")
        sync(sub, pub)
