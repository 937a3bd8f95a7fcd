"""Engine versions as the router reads them: capabilities, connector groups, pairing, the
paused 503 (pure tables), and P placement within connector groups."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import pytest

from router.engines.client import EngineClient
from router.engines.metrics_text import kv_discarded
from router.engines.pool import Pool
from router.engines.versions import EngineVersion, engine_paused, parse, registration_generation
from router.errors import Unavailable
from router.lifecycle.health import check
from router.turn.decide import attempts
from router.turn.decide.attempts import Attempt, Next

PAUSED = {
    "error": {
        "message": "Generation is paused. Please retry after it resumes.",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}


@pytest.mark.parametrize(
    ("version", "streams", "connector", "group"),
    [
        ("0.32.0", False, 14, "nixl-v14"),
        ("0.33.0", True, 15, "nixl-v15"),
        ("0.33.1.dev4+g1234", True, 15, "nixl-v15"),
        ("0.34.0", True, None, "vllm-0.34"),
        ("0.21.0", False, None, "vllm-0.21"),
        ("", False, None, ""),
        ("nonsense", False, None, ""),
    ],
)
def test_what_a_version_says(
    version: str, streams: bool, connector: int | None, group: str
) -> None:
    v = EngineVersion(version)
    assert v.streams_handles is streams and v.pause_rejects is streams
    assert v.connector_version == connector and v.group == group


@pytest.mark.parametrize(
    ("a", "b", "pairs"),
    [("0.32.0", "0.32.1", True), ("0.32.0", "0.33.0", False), ("", "0.33.0", True)],
)
def test_pairing(a: str, b: str, pairs: bool) -> None:
    assert EngineVersion(a).pairs_with(EngineVersion(b)) is pairs


@pytest.mark.parametrize(
    ("body", "version"),
    [({"version": "0.33.0"}, "0.33.0"), ({"version": 33}, ""), ([], ""), (None, "")],
)
def test_parse(body: Any, version: str) -> None:
    assert parse(body) == version


@pytest.mark.parametrize(
    ("params", "generation"),
    [
        ({"remote_registration_generation": 2}, 2),
        ({}, 0),
        (None, 0),
        ({"remote_registration_generation": True}, 0),
    ],
)
def test_registration_generation(params: Any, generation: int) -> None:
    assert registration_generation(params) == generation


@pytest.mark.parametrize(
    ("status", "body", "paused"),
    [
        (503, PAUSED, True),
        (503, {"error": {"message": "x", "type": "T", "code": "engine_paused"}}, True),
        (503, {"error": "down"}, False),
        (500, PAUSED, False),
        (503, None, False),
    ],
)
def test_engine_paused(status: int, body: Any, paused: bool) -> None:
    assert engine_paused(status, body) is paused


def test_a_paused_p_is_busy_and_its_handle_unspent() -> None:
    step = attempts.after_prefill(
        Attempt(503, False, True, with_handle=True, with_ids=False, paused=True)
    )
    assert step.next is Next.ANOTHER_P and not step.handle_used and not step.failed
    # Any other 503 with a handle: the handle may have been read.
    step = attempts.after_prefill(Attempt(503, False, True, with_handle=True, with_ids=False))
    assert step.handle_used


def _pool(p: list[str], d: list[str]) -> Pool:
    pool = Pool(
        tuple(f"http://p{i}" for i in range(len(p))), tuple(f"http://d{i}" for i in range(len(d)))
    )
    for inst, version in zip(pool.instances(), [*p, *d], strict=True):
        inst.ident.note_version(version)
    return pool


def test_placement_within_connector_groups() -> None:
    pool = _pool(["0.32.0", "0.33.0"], ["0.33.0"])
    # Only the 0.33 P has a D to pair with.
    assert {pool.pick("prefill").url for _ in range(4)} == {"http://p1"}
    p32 = pool.find("prefill", "http://p0")
    assert p32 is not None
    with pytest.raises(Unavailable, match="nixl-v14"):
        pool.pick("decode", peer=p32)
    p33 = pool.find("prefill", "http://p1")
    assert p33 is not None and pool.pick("decode", peer=p33).url == "http://d0"
    assert pool.groups() == {
        "nixl-v14": {"prefill": ["http://p0"], "decode": []},
        "nixl-v15": {"prefill": ["http://p1"], "decode": ["http://d0"]},
    }
    # A D whose version is not known yet pairs with every P.
    unknown = _pool(["0.32.0", "0.33.0"], [""])
    assert {unknown.pick("prefill").url for _ in range(4)} == {"http://p0", "http://p1"}


def test_a_restart_forgets_the_version_and_the_registration() -> None:
    pool = _pool([], ["0.33.0"])
    ident = pool.instances("decode")[0].ident
    ident.note_started(100.0)
    ident.note_registration(1)
    ident.note_registration(2)
    assert (
        ident.streams_handles
        and ident.registration_changed(1)
        and not ident.registration_changed(2)
    )
    ident.note_started(200.0)  # a new process: another vLLM, perhaps
    assert ident.version.version == "" and not ident.streams_handles and ident.registration == 0


class VersionAnswers:
    """/version by base URL, and a /metrics whose start time the test sets."""

    def __init__(self, versions: dict[str, str]) -> None:
        self.versions = versions
        self.started = 100.0
        self.gets: list[str] = []
        self.ready_status = 404  # /v1/pd_kv_ready (vllm#51919): not served
        self.posts: list[str] = []

    async def get(self, url: str, *, timeout: float) -> tuple[int, bytes]:
        self.gets.append(url)
        base, _, path = url.rpartition("/")
        if path == "version":
            return 200, msgspec.json.encode({"version": self.versions[base]})
        return 200, f"process_start_time_seconds {self.started}\n".encode()

    async def post_json(self, url: str, body: Any, **_: Any) -> tuple[int, bytes]:
        self.posts.append(url)
        return self.ready_status, b""


async def test_the_health_loop_reads_versions_at_start_after_a_restart_and_for_p_always() -> None:
    pool = Pool(("http://p0",), ("http://d0",))
    p, d = pool.instances()
    engines = VersionAnswers({"http://p0": "0.32.0", "http://d0": "0.33.0"})
    client = cast(EngineClient, engines)
    for _ in range(2):
        await check(client, p, 1.0)
        await check(client, d, 1.0)
    assert (p.ident.version.version, d.ident.version.version) == ("0.32.0", "0.33.0")
    assert engines.gets.count("http://p0/version") == 2  # a P's restart shows nowhere else
    assert engines.gets.count("http://d0/version") == 1  # known: not read again
    engines.versions = {"http://p0": "0.33.0", "http://d0": "0.32.0"}  # both upgraded...
    engines.started = 200.0  # ...and D restarted
    await check(client, p, 1.0)
    await check(client, d, 1.0)
    assert (p.ident.version.version, d.ident.version.version) == ("0.33.0", "0.32.0")
    assert d.ident.restarts == 1 and engines.gets.count("http://d0/version") == 2
    # vllm#51919's /v1/pd_kv_ready: asked of D only, once per process (404: not served).
    assert engines.posts == ["http://d0/v1/pd_kv_ready"] * 2 and d.ident.parks is False


@pytest.mark.parametrize(
    ("status", "parks"),
    [(400, True), (422, True), (404, False), (405, False), (401, None), (503, None)],
)
async def test_a_d_serving_the_ready_route_is_learned(status: int, parks: bool | None) -> None:
    pool = Pool(("http://p0",), ("http://d0",))
    p, d = pool.instances()
    engines = VersionAnswers({"http://p0": "0.33.0", "http://d0": "0.33.0"})
    engines.ready_status = status
    await check(cast(EngineClient, engines), p, 1.0)
    await check(cast(EngineClient, engines), d, 1.0)
    assert d.ident.parks is parks and p.ident.parks is None
    assert engines.posts == ["http://d0/v1/pd_kv_ready"]


SLEEP_STATE = (
    'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="awake"}} {}\n'
    'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="weights_offloaded"}} {}\n'
    'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="discard_all"}} {}\n'
)


@pytest.mark.parametrize(
    ("awake", "offloaded", "discarded", "gone"),
    [(1, 0, 0, False), (0, 1, 0, True), (0, 0, 1, True), (0, 0, 0, False), ("x", "x", "x", False)],
)
def test_the_sleep_gauge(awake: Any, offloaded: Any, discarded: Any, gone: bool) -> None:
    text = SLEEP_STATE.format(awake, offloaded, discarded).encode()
    assert kv_discarded(text) is gone


def test_handles_made_before_a_sleep_are_of_an_earlier_registration() -> None:
    ident = _pool([], ["0.33.0"]).instances("decode")[0].ident
    ident.note_registration(1)
    assert not ident.registration_changed(1, made_at=50.0)
    ident.note_sleep(True, 100.0)
    ident.note_sleep(True, 101.0)  # still asleep: the latest time it was seen so
    ident.note_sleep(False, 102.0)
    assert ident.registration_changed(1, made_at=50.0) and ident.registration_changed(0, 101.0)
    assert not ident.registration_changed(1, made_at=103.0)
    assert not ident.registration_changed(0, made_at=0.0)  # no time, no generation: not judged
