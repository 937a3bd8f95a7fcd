"""Where a stored handle may send P (router/turn/aim.py): only to the engine id, side-channel
host and port pinned for the recorded D, from its own first answer or a state signed with our
secret; a later answer naming another address is refused unless D restarted (issue 50)."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Settings
from router.engines.identity import EngineIdentity
from router.services import Services
from router.turn.aim import aims_at_its_d
from sessions import integrity
from sessions import model as sm
from tests.support.services import make_services

SECRET = "unit-tests-session-secret"
D = "http://d1"
ANNOUNCED = {"remote_engine_id": "d-engine", "remote_host": "10.0.0.2", "remote_port": 5600}
ANNOUNCED_ORIGIN = ("d-engine", "10.0.0.2", 5600)


def services(secret: str = "") -> Services:
    return make_services(Settings(prefill=("http://p1",), decode=(D,), session_secret=secret))


def state(decode: str = D, **edit: Any) -> sm.SessionState:
    params = {**ANNOUNCED, "remote_block_ids": [[1, 2]], "remote_num_tokens": 20, **edit}
    return sm.SessionState(decode=decode, kv_transfer_params=params, token_count=20)


@pytest.mark.parametrize(
    ("edit", "decode", "aims"),
    [
        ({}, D, True),
        ({"remote_port": 5601}, D, False),
        ({"remote_host": "10.0.0.9"}, D, False),
        ({"remote_engine_id": "other"}, D, False),
        ({"remote_port": "5600"}, D, False),
        ({}, "http://gone", False),  # a D the pool does not know
    ],
)
def test_only_what_the_recorded_d_announced(edit: dict[str, Any], decode: str, aims: bool) -> None:
    svc = services()
    d = svc.pool.find("decode", D)
    assert d is not None
    assert not aims_at_its_d(svc, "k", state()), "nothing announced yet (unsigned)"
    d.ident.admit(ANNOUNCED_ORIGIN)  # D's own answer pinned it
    assert aims_at_its_d(svc, "k", state(decode, **edit)) is aims


def test_a_signed_state_vouches_for_its_origin_and_a_restart_forgets_it() -> None:
    svc = services(SECRET)
    signed = integrity.sign((SECRET,), "k", state())
    assert aims_at_its_d(svc, "k", signed), "signed with our secret: a router saw D announce it"
    assert not aims_at_its_d(svc, "k", state(remote_port=1)), "unsigned: not vouched for"
    d = svc.pool.find("decode", D)
    assert d is not None
    d.ident.note_started(100.0)
    d.ident.note_started(200.0)  # a new process: what the old one announced is forgotten
    assert not aims_at_its_d(svc, "k", state())


def identity() -> EngineIdentity:
    ident = EngineIdentity(label="decode instance http://d1")
    assert ident.admit(("d_dp0", "10.0.0.2", 5600)), "the first handle pins its rank"
    return ident


@pytest.mark.parametrize(
    ("origin", "kept"),
    [
        (("d_dp0", "10.0.0.2", 5600), True),  # the pinned rank, again
        (("d_dp1", "10.0.0.2", 5601), True),  # a sibling rank: same process, same host
        (("d_dp0", "10.0.0.2", 5999), False),  # the pinned rank, moved
        (("d_dp0", "127.0.0.1", 5600), False),  # the pinned rank, another host
        (("d_dp1", "10.0.0.9", 5601), False),  # a "rank" on another host
        (("d_dp1", "10.0.0.2", 5600), False),  # a "rank" on the pinned rank's own port
        (("other", "10.0.0.2", 5601), False),  # another engine: a restart not seen yet
    ],
)
def test_a_side_channel_is_pinned_per_rank(origin: tuple[str, str, int], kept: bool) -> None:
    ident = identity()
    assert ident.admit(origin) is kept
    assert ident.owns(origin) is kept, "a refused address is never pinned"
    assert ident.owns(("d_dp0", "10.0.0.2", 5600)), "the first pin stays"


def test_a_refusal_is_said_once_per_address(caplog: pytest.LogCaptureFixture) -> None:
    ident = identity()
    for _ in range(3):
        assert not ident.admit(("d_dp0", "10.0.0.2", 1))
    said = [
        r for r in caplog.records if "another side channel than the one it showed" in r.getMessage()
    ]
    assert len(said) == 1, said
    assert "decode instance http://d1" in said[0].getMessage()


def test_a_restart_seen_on_metrics_lets_d_move() -> None:
    ident = identity()
    ident.note_started(100.0)
    assert not ident.admit(("new-engine", "10.0.0.2", 6000))
    ident.note_started(200.0)  # a new process start time: what the old one pinned is gone
    assert ident.admit(("new-engine", "10.0.0.2", 6000))
    assert not ident.owns(("d_dp0", "10.0.0.2", 5600))


def test_a_new_engine_id_in_a_handle_alone_does_not_unpin() -> None:
    """A handle may be tampered with: only D's identity endpoint (its process start time)
    says it restarted. The engine id of a kept handle still marks the start time stale."""
    ident = identity()
    ident.note_engine_id("d_dp0")
    assert not ident.admit(("forged", "10.0.0.66", 5600))
    assert ident.engine_id == "d"
