"""The tests' free ports (harness/ports.py): below the kernel's ephemeral range, where no
client socket of the suite can take one between the probe and the server's bind, and a slice
per pytest-xdist worker, so that two workers never hand out the same port."""

from __future__ import annotations

import itertools
import os
import socket

from harness import ports


def test_each_worker_has_its_own_slice_below_the_ephemeral_range() -> None:
    slices = [ports.worker_slice(f"gw{n}", 32768) for n in range(8)]
    assert slices[0] == range(32768 - ports.SLICE, 32768)
    for a, b in itertools.pairwise(slices):
        assert b.stop == a.start  # adjacent, never overlapping
    assert all(s.start >= ports.LOWEST and len(s) == ports.SLICE for s in slices)
    assert ports.worker_slice(None, 32768) == slices[0]  # no xdist: the first slice


def test_a_slice_never_goes_below_the_privileged_ports() -> None:
    low = ports.worker_slice("gw3", 3000)
    assert low.start == ports.LOWEST and low.stop > low.start


def test_a_port_held_by_a_server_is_not_handed_out() -> None:
    first = ports.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        handed = {ports.free_port() for _ in range(ports.SLICE)}
    assert first not in handed
    here = ports.worker_slice(os.environ.get("PYTEST_XDIST_WORKER"), ports._ephemeral_low())
    assert first in here and handed <= set(here)


def test_a_span_is_free_and_the_next_port_lies_past_it() -> None:
    """A two-rank engine listens on PORT and PORT + 1: neither is handed out again next."""
    first = ports.free_port(span=2)
    after = [ports.free_port() for _ in range(3)]
    assert not {first, first + 1} & set(after)
    assert not {p + 1 for p in after} & set(after)  # PORT + 1 (a KV events replay) stays free
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", first))
        b.bind(("127.0.0.1", first + 1))
