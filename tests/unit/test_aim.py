"""Where a stored handle may send P (router/turn/aim.py): only to the engine id, side-channel
host and port the recorded D announced, in its own answers or in a state signed with our
secret; a restart forgets what it announced."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Settings
from router.connectors.select import select
from router.engines.client import Upstream
from router.engines.pool import Pool
from router.metrics import Metrics
from router.services import Services, StoreGuard
from router.turn.aim import aims_at_its_d
from sessions import integrity
from sessions import model as sm
from sessions.memory_store import MemorySessionStore

SECRET = "unit-tests-session-secret"
D = "http://d1"
ANNOUNCED = {"remote_engine_id": "d-engine", "remote_host": "10.0.0.2", "remote_port": 5600}


def services(secret: str = "") -> Services:
    settings = Settings(prefill=("http://p1",), decode=(D,), session_secret=secret)
    pool = Pool(settings.prefill, settings.decode)
    return Services(
        settings,
        Upstream(settings),
        pool,
        MemorySessionStore(),
        StoreGuard(1),
        Metrics(pool, lambda: False),
        select(settings),
    )


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
    d.ident.note_origin(svc.connector.origin(ANNOUNCED))  # D's own answer
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
