"""Fixtures of the real-vLLM tier: P, D and a reference engine started once per test run.

The tier runs only when `KVBATON_TEST_VLLM_PYTHON` names the engine venv's Python
(`make test-vllm` sets it); the test modules skip themselves otherwise.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.procs import ROOT, free_port
from harness.router import RouterProc, router
from tests.vllm import engines
from tests.vllm.engines import Engine, EngineSpec, KvEvents

PYTHON_ENV = "KVBATON_TEST_VLLM_PYTHON"
MODEL_ENV = {"char": "KVBATON_TEST_VLLM_MODEL", "bpe": "KVBATON_TEST_VLLM_BPE_MODEL"}
DEFAULT_MODEL = {
    "char": ROOT / ".vllm-test" / "tiny-llama",
    "bpe": ROOT / ".vllm-test" / "tiny-llama-bpe",
}
# Three engines starting together on two cores take 48-103 s (measured), and the NIXL warm-up
# after them under a second (up to ~80 s on a loaded machine); the first test also pays for
# this in its timeout.
START_TIMEOUT = float(os.environ.get("KVBATON_TEST_VLLM_START_TIMEOUT", "180"))
HERE = Path(__file__).resolve().parent
CPU_BIND = os.environ.get("KVBATON_TEST_VLLM_CPU_BIND", "nobind")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The first test of each module of this tier starts its engines (one tokenizer kind per
    module): give it their start-up time too."""
    firsts: dict[Path, pytest.Item] = {}
    for item in items:
        if item.path.parent == HERE:
            firsts.setdefault(item.path, item)
    for first in firsts.values():
        marker = first.get_closest_marker("timeout")
        base = float(marker.args[0]) if marker and marker.args else float(config.getini("timeout"))
        first.add_marker(pytest.mark.timeout(base + 2 * START_TIMEOUT + 60))


@dataclass(frozen=True)
class Engines:
    p: Engine
    d: Engine
    ref: Engine  # no connector: answers computed from scratch
    events: KvEvents


def distinct_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def model_dir(python: str, kind: str) -> Path:
    """The tiny model of that tokenizer kind `make test-vllm` built, or built here (5 s)."""
    path = Path(os.environ.get(MODEL_ENV[kind]) or DEFAULT_MODEL[kind])
    if not (path / "config.json").exists():
        subprocess.run(
            [python, str(HERE / "build_model.py"), str(path), kind],
            check=True,
            capture_output=True,
            timeout=120,
        )
    return path


def report(config: pytest.Config, line: str) -> None:
    """A line on the terminal, past pytest's output capture."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(line)


def start_engines(
    kind: str,
    tmp_path_factory: pytest.TempPathFactory,
    config: pytest.Config,
    *,
    tag: str = "",
    kv_config: dict[str, Any] | None = None,
    reference: bool = True,
    d_events: str = "",
) -> Iterator[Engines]:
    """P, D and the reference engine on the tiny model with the `kind` tokenizer (P and D
    with `kv_config`, default bidirectional NIXL pull); stopped when the module that uses
    them is done (one set runs at a time). Without `reference`, P answers the reference
    requests (a request without kv_transfer_params is an ordinary one): for a module whose
    tests read no counter of P, one engine fewer to start. `d_events`: D's KV-events endpoint
    (default: an ipc:// one that D binds)."""
    python = os.environ[PYTHON_ENV]
    model = str(model_dir(python, kind))
    tag = tag or kind
    work = tmp_path_factory.mktemp(f"vllm-{tag}")
    log_dir = Path(tempfile.gettempdir()) / "kvbaton-test-logs"
    log_dir.mkdir(exist_ok=True)
    p_port, d_port, ref_port, p_side, d_side = distinct_ports(5)
    # P and D serve the render routes (Responses turns are verified with P's); the reference
    # engine keeps vLLM's default, which refuses them.
    d_kv = d_events or f"ipc://{work}/kv-d.ipc"
    specs = [
        EngineSpec(f"p-{tag}", p_port, CPU_BIND, p_side, f"ipc://{work}/kv-p.ipc", kv_config, True),
        EngineSpec(f"d-{tag}", d_port, CPU_BIND, d_side, d_kv, kv_config, True),
    ]
    if reference:
        specs.append(EngineSpec(f"ref-{tag}", ref_port, CPU_BIND))
    started: list[Engine] = []
    events: KvEvents | None = None
    try:
        t0 = time.monotonic()
        for spec in specs:
            started.append(engines.launch(python, model, spec, work, log_dir))
        engines.wait_ready(started, START_TIMEOUT)
        took = time.monotonic() - t0
        names = "P, D and reference" if reference else "P and D (P answers the references)"
        report(config, f"\nvLLM {names} ({tag}) ready in {took:.1f} s")
        p, d, ref = (*started, started[0]) if not reference else started
        if kv_config is None:  # push mode has no D->P read to warm up
            t0 = time.monotonic()
            retries = engines.warm_up(p, d, START_TIMEOUT)
            took = time.monotonic() - t0
            report(config, f"NIXL warm-up (P->D, D->P) took {took:.1f} s, {retries} retries")
        # Subscribe before any traffic: PUB/SUB drops what is sent before the connection.
        events = KvEvents({"p": p.spec.kv_events, "d": d.spec.kv_events})
        events.start()
        yield Engines(p, d, ref, events)
    finally:
        t0 = time.monotonic()
        if events is not None:
            events.stop()
        engines.stop(started)
        report(config, f"\nvLLM engines ({tag}) stopped in {time.monotonic() - t0:.1f} s")


@pytest.fixture(scope="module")
def vllm_engines(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[Engines]:
    """The character-tokenizer engines: every answer re-tokenizes into D's ids."""
    yield from start_engines("char", tmp_path_factory, pytestconfig)


@pytest.fixture(scope="module")
def vllm_bpe_engines(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[Engines]:
    """The byte-level BPE engines: answers often re-tokenize into other ids than D's."""
    yield from start_engines("bpe", tmp_path_factory, pytestconfig)


def start_router(engines_: Engines, redis_url: str, name: str, *extra: str) -> Iterator[RouterProc]:
    """kvbaton in front of P and D with its defaults (--verify-prefix tokens, block size
    read from vllm:cache_config_info, no --stream-kv-params: stock vLLM 0.32), and `extra`."""
    # Generous timeouts: the defaults (120 s prefill, 60 s idle, 0.25 s store) are for real
    # deployments; a machine loaded by something else makes this tier slow, not wrong (with
    # vLLM's multiprocess executor, engine legs stalled for minutes and Redis calls missed 2 s).
    # --release-after 900: no handle of one test is released as idle during another (a release
    # is a /v1/completions request to P, which tests count); test_pins ends its conversations.
    args = (
        "--release-after",
        "900",
        *extra,
        "--store-timeout",
        "10",
        "--prefill-timeout",
        "300",
        "--decode-first-byte-timeout",
        "300",
        "--decode-idle-timeout",
        "300",
    )
    # The router reads both engines' KV events (the same ipc:// publishers the tests read).
    for engine in (engines_.p, engines_.d):
        args += ("--kv-events", f"{engine.url}={engine.spec.kv_events}")
    urls = ([engines_.p.url], [engines_.d.url])
    # The router checks every engine's /v1/models and /metrics before it listens, and again
    # as it starts: on a loaded machine that took over the harness's default 20 s.
    with router(*urls, *args, redis_url=redis_url, name=name, ready_timeout=START_TIMEOUT) as r:
        engines.PREFILLS[r.url] = urls[0]  # every plain `hit` through it must move KV
        try:
            yield r
        finally:
            engines.PREFILLS.pop(r.url, None)


@pytest.fixture(scope="module")
def vllm_push_engines(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[Engines]:
    """P and D with NixlPushConnector (character tokenizer); P answers the references (the
    push tests read D's counters only). D's KV-events endpoint is connect-style
    (`tcp://127.0.0.1:PORT`, no wildcard): vLLM then connects instead of binding, as a user's
    engine would, and the router must say so (test_real_vllm_push)."""
    yield from start_engines(
        "char",
        tmp_path_factory,
        pytestconfig,
        tag="push",
        kv_config=engines.PUSH,
        reference=False,
        d_events=f"tcp://127.0.0.1:{distinct_ports(1)[0]}",
    )


@pytest.fixture(scope="module")
def vllm_push_router(vllm_push_engines: Engines, redis_url_session: str) -> Iterator[RouterProc]:
    yield from start_router(
        vllm_push_engines, redis_url_session, "vllm-push-router", "--kv-connector", "nixl-push"
    )


@pytest.fixture(scope="module")
def vllm_router(vllm_engines: Engines, redis_url_session: str) -> Iterator[RouterProc]:
    yield from start_router(vllm_engines, redis_url_session, "vllm-router")


@pytest.fixture(scope="module")
def vllm_bpe_router(vllm_bpe_engines: Engines, redis_url_session: str) -> Iterator[RouterProc]:
    yield from start_router(vllm_bpe_engines, redis_url_session, "vllm-bpe-router")
