"""KV-cache events as vLLM 0.32 publishes them: ZMQ PUB stream, ROUTER replay (the decoder:
vllm_sim/events_decode.py).

Wire: multipart (topic, 8-byte big-endian seq, msgpack [ts, [events...], data_parallel_rank]).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


# vllm#42892 dropped array_like from the event structs: each event is a msgpack map tagged
# "type", while the batch around it stays positional. omit_defaults is off on purpose: vLLM
# 0.32 was measured sending lora_id/lora_name as null and group_idx/kv_cache_spec_kind set.
class BlockStored(msgspec.Struct, tag_field="type", tag=True, gc=False):
    block_hashes: list[int]  # uint64 (may exceed 2**63), as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"

    def __post_init__(self) -> None:
        # Measured 0.32 sends one null extra key per block rather than omitting the field.
        if self.extra_keys is None:
            self.extra_keys = [None] * len(self.block_hashes)


class BlockRemoved(msgspec.Struct, tag_field="type", tag=True, gc=False):
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = 0


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag=True, gc=False):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int


class KVEventPublisher:
    """Publishes event batches on a ZMQ PUB socket and serves replays on a ROUTER socket.

    Both sockets belong to one background thread fed by a queue, so publish() is safe from
    any thread (or an asyncio loop) and never blocks; a full queue drops the batch.
    """

    def __init__(
        self,
        port: int | None,
        replay_port: int | None,
        topic: str = "kv-events",
        host: str = "127.0.0.1",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        clock: Callable[[], float] = time.time,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        self.port = port
        self.replay_port = replay_port
        self.topic = topic
        self.host = host
        self.buffer_steps = buffer_steps
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0
        self._clock = clock
        self._hwm = hwm
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()
        self._state = "new"  # new -> running -> closed; "disabled" when port is None
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    def start(self) -> None:
        """Bind the sockets (in the caller, so errors surface here) and start the thread."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"KVEventPublisher.start() when {self._state}")
            if self.port is None:
                self._state = "disabled"
                return
            self._ctx = zmq.Context()
            try:
                pub = self._bind(zmq.PUB, self.port)
                router = (
                    None if self.replay_port is None else self._bind(zmq.ROUTER, self.replay_port)
                )
            except zmq.ZMQError:
                self._ctx.destroy(linger=0)
                self._state = "closed"
                raise
            self.port = _bound_port(pub)
            if router is not None:
                self.replay_port = _bound_port(router)
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_w.setblocking(False)
            # Sockets move to the thread here; Thread.start() is the memory barrier zmq needs.
            self._thread = threading.Thread(
                target=self._run, args=(pub, router), name="kv-events", daemon=True
            )
            self._thread.start()
            self._state = "running"

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (one engine step); a no-op when disabled, closed or empty."""
        if not events or self._state in ("disabled", "closed"):
            return
        if self._state == "new":
            raise RuntimeError("KVEventPublisher.publish() before start()")
        batch = _EventBatch(self._clock(), list(events), self.data_parallel_rank)
        # Encode here: the caller may reuse its lists once publish() returns.
        payload = self._encoder.encode(batch)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            logger.warning("KV events queue full; dropped a batch (%d so far)", self.dropped)
            return
        self._wake()

    def close(self) -> None:
        """Stop the thread and close the sockets; idempotent."""
        with self._lock:
            if self._state != "running":
                self._state = "closed"
                return
            self._state = "closed"
        self._queue.put(_STOP)
        self._wake()
        assert self._thread is not None and self._ctx is not None
        self._thread.join()
        self._ctx.term()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()

    def __enter__(self) -> KVEventPublisher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bind(self, kind: int, port: int) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        host = self.host
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        try:
            # Port 0 asks for a free port ("*" is zmq's spelling); the host is never a wildcard.
            sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _wake(self) -> None:
        if self._wake_w is None:
            return
        # Buffer full: a wake-up is already pending. Closed: the thread is gone.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self, pub: zmq.Socket[bytes], router: zmq.Socket[bytes] | None) -> None:
        assert self._wake_r is not None
        wake_fd = self._wake_r.fileno()
        stream = _Stream(pub, self.topic.encode(), self.buffer_steps)
        poller = zmq.Poller()
        poller.register(wake_fd, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake_fd in ready:
                    self._wake_r.recv(65536)
                # Send queued batches before answering replays, so a replay requested after
                # publish() returned includes that batch.
                if not self._drain(stream):
                    return
                if router is not None and router in ready:
                    _serve_replays(router, stream.buffer)
        except Exception:
            logger.exception("KV events publisher thread failed")
        finally:
            pub.close(linger=100)
            if router is not None:
                router.close(linger=0)

    def _drain(self, stream: _Stream) -> bool:
        """Send every queued batch; False once close() asked the thread to stop."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            assert isinstance(item, bytes)
            stream.send(item)


class _Stream:
    """The PUB socket with its sequence numbers and the replay buffer (publisher thread only)."""

    def __init__(self, pub: zmq.Socket[bytes], topic: bytes, buffer_steps: int) -> None:
        self.pub = pub
        self.topic = topic
        self.seq = 0  # per publisher, from 0, as vLLM: a restart resets it
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)

    def send(self, payload: bytes) -> None:
        # PUB never blocks: past the high-water mark zmq drops for that subscriber.
        self.pub.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload))
        self.buffer.append((self.seq, payload))
        self.seq += 1


def _bound_port(sock: zmq.Socket[bytes]) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.rsplit(b":", 1)[1])


def _serve_replays(router: zmq.Socket[bytes], buffer: collections.deque[tuple[int, bytes]]) -> None:
    """Answer every pending replay request as vLLM's ZmqEventPublisher._service_replay does:
    a request is (identity, delimiter, start seq) exactly, else it is dropped unanswered with
    a warning; the answer is one message per buffered batch with seq >= start, then the end
    marker, each as (identity, b"", seq, payload)."""
    while True:
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(frames) != 3:
            logger.warning("Invalid replay request: %s", frames)
            continue
        client_id, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in buffer:
            if seq >= start:
                router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((client_id, b"", END_OF_REPLAY, b""))
