"""Push mode's P coordinates: what D must be told before P answers (vLLM's push demo proxy
takes them from its command line). From `--prefill-coordinates`, the admin API, a start-up
probe of P, or P's own `kv_transfer_params` on every answer (engine id, side-channel host and
port, tp and pp sizes, and `transfer_mode` on vLLM with #50620)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import msgspec

from router.connectors.nixl.params import NULL_HANDOFF
from router.engines.client import EngineClient
from router.engines.pool import Instance
from router.errors import UpstreamFailure

log = logging.getLogger("kvbaton.backends")

Source = Literal["config", "admin", "probe", "response"]
SPEC_HELP = "URL=ENGINE_ID@SIDE_HOST:SIDE_PORT[,tp=N][,pp=N]"
# An instance whose coordinates are unknown is probed again at most this often.
PROBE_EVERY_S = 5.0

# The pull null handoff: P prefills one token and answers with its own params (coordinates).
PROBE_PARAMS: Mapping[str, Any] = NULL_HANDOFF


@dataclass(frozen=True)
class Coordinates:
    engine_id: str
    host: str  # P's side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST), not its HTTP host
    port: int  # P's side-channel port
    tp_size: int = 1
    pp_size: int = 1
    transfer_mode: str = ""  # what P said ("push"/"pull"; "" before vllm#50620)
    source: Source = "config"

    def view(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Known:
    """One P's coordinates as the router knows them."""

    coords: Coordinates | None = None
    why_unknown: str = "not probed yet"
    probed_at: float = 0.0
    probe: asyncio.Task[None] | None = None  # a probe running in the background


def _int(text: str, what: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{spec!r}: {what} must be an integer, not {text!r}") from None
    if value < 1 or (what == "port" and value > 65535):
        raise ValueError(f"{spec!r}: {what} {value} is out of range")
    return value


def parse_spec(spec: str) -> tuple[str, Coordinates]:
    """`URL=ENGINE_ID@HOST:PORT[,tp=N][,pp=N]` -> (URL, coordinates); ValueError if not."""
    url, eq, rest = spec.partition("=")
    head, *options = rest.split(",")
    engine_id, at, where = head.rpartition("@")
    host, colon, port = where.rpartition(":")
    if not (url and eq and at and colon and engine_id and host):
        raise ValueError(f"{spec!r}: expected {SPEC_HELP}")
    sizes = {"tp": 1, "pp": 1}
    for option in options:
        key, _, value = option.partition("=")
        if key not in sizes:
            raise ValueError(f"{spec!r}: unknown option {key!r} (tp=N, pp=N)")
        sizes[key] = _int(value, key, spec)
    coords = Coordinates(
        engine_id, host, _int(port, "port", spec), sizes["tp"], sizes["pp"], source="config"
    )
    return url.rstrip("/"), coords


def from_params(params: object, source: Source) -> Coordinates | None:
    """P's coordinates from the `kv_transfer_params` it answered with (None: not there)."""
    if not isinstance(params, Mapping):
        return None
    engine_id, host, port = (
        params.get(k) for k in ("remote_engine_id", "remote_host", "remote_port")
    )
    if not (isinstance(engine_id, str) and engine_id and isinstance(host, str) and host):
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    tp, pp, mode = params.get("tp_size", 1), params.get("pp_size", 1), params.get("transfer_mode")
    return Coordinates(
        engine_id,
        host,
        port,
        tp if isinstance(tp, int) and tp > 0 else 1,
        pp if isinstance(pp, int) and pp > 0 else 1,
        mode if isinstance(mode, str) else "",
        source,
    )


def learn(known: Known, params: object, source: Source, label: str) -> None:
    """Record what P said about itself; a pull-mode P (transfer_mode "pull") is not usable."""
    coords = from_params(params, source)
    if coords is None:
        known.coords, known.why_unknown = None, "its kv_transfer_params carry no coordinates"
        return
    if coords.transfer_mode == "pull":
        known.coords = None
        known.why_unknown = "it answered transfer_mode 'pull': it runs NixlConnector, not push"
        return
    old = known.coords
    if old is not None and (old.engine_id, old.host, old.port) != (
        coords.engine_id,
        coords.host,
        coords.port,
    ):
        log.warning(
            "%s now says engine id %s at %s:%d (was %s at %s:%d, from %s)",
            label,
            coords.engine_id,
            coords.host,
            coords.port,
            old.engine_id,
            old.host,
            old.port,
            old.source,
        )
    if old is not None and source == "response" and old.source != "response":
        coords = Coordinates(**{**asdict(coords), "source": old.source})
    known.coords, known.why_unknown = coords, ""


def probe_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "kvbaton coordinates probe",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": dict(PROBE_PARAMS),
    }


async def probe(engines: EngineClient, url: str, model: str, known: Known, timeout: float) -> None:
    """Ask P for its coordinates with a one-token pull-style prefill (its answer carries its
    params); P holds that one block for its kv_lease_duration."""
    known.probed_at = time.monotonic()
    try:
        status, raw = await engines.post_json(
            url + "/v1/completions",
            probe_body(model),
            request_id=f"kvbaton-probe-{uuid.uuid4().hex}",
            timeout=timeout,
        )
        body = msgspec.json.decode(raw) if status == 200 else None
    except (UpstreamFailure, msgspec.DecodeError) as exc:
        known.why_unknown = f"the coordinates probe failed: {exc}"
        return
    if not isinstance(body, dict):
        known.why_unknown = f"the coordinates probe answered HTTP {status}"
        return
    learn(known, body.get("kv_transfer_params"), "probe", url)


def due(known: Known, configured: bool, now: float) -> bool:
    """Whether to probe now: unknown, not configured, and not probed in the last while."""
    return known.coords is None and not configured and now - known.probed_at >= PROBE_EVERY_S


def d_params(coords: Coordinates, request_id: str, transfer_id: str) -> dict[str, Any]:
    """D's `kv_transfer_params` in push mode: P's coordinates, no block ids."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": coords.engine_id,
        "remote_host": coords.host,
        "remote_port": coords.port,
        "tp_size": coords.tp_size,
        "pp_size": coords.pp_size,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }


def p_params(transfer_id: str) -> dict[str, Any]:
    """P's `kv_transfer_params` in push mode: the null handoff plus the transfer id."""
    return {**PROBE_PARAMS, "transfer_id": transfer_id}


def from_admin(role: str, fields: Mapping[str, Any]) -> Coordinates:
    """Coordinates an admin add gave (the seeds' `engine_id`, `side_channel_host`, ...)."""
    engine_id, host, port = (
        fields.get(k) for k in ("engine_id", "side_channel_host", "side_channel_port")
    )
    tp, pp = fields.get("tp_size", 1), fields.get("pp_size", 1)
    if not (isinstance(engine_id, str) and engine_id and isinstance(host, str) and host):
        port = None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(
            "push coordinates need engine_id, side_channel_host and side_channel_port "
            "(1-65535) together"
        )
    if not (isinstance(tp, int) and isinstance(pp, int)) or min(tp, pp) < 1 or role != "prefill":
        raise ValueError("coordinates are for prefill instances, tp_size/pp_size >= 1")
    assert isinstance(engine_id, str) and isinstance(host, str)
    return Coordinates(engine_id, host, port, tp, pp, source="admin")


def configured(specs: tuple[str, ...]) -> dict[str, Coordinates]:
    """--prefill-coordinates by P URL (config validation has already parsed each spec)."""
    return dict(parse_spec(spec) for spec in specs)


@dataclass
class Directory:
    """Every P's coordinates as the router knows them, by URL: configured, given by the admin
    API, probed, or read from P's answers."""

    configured: dict[str, Coordinates] = field(default_factory=dict)
    by_url: dict[str, Known] = field(default_factory=dict)

    def of(self, url: str) -> Known:
        known = self.by_url.get(url)
        if known is None:
            known = self.by_url[url] = Known()
            given = self.configured.get(url)
            if given is not None:
                known.coords, known.why_unknown = given, ""
        return known

    def given(self, url: str, coords: Coordinates) -> None:
        """Coordinates from the admin API."""
        known = self.of(url)
        known.coords, known.why_unknown = coords, ""

    async def learn(
        self, engines: EngineClient, inst: Instance, model: str, timeout: float, *, force: bool
    ) -> None:
        """A P's coordinates: configured ones stay, else a probe (at most every
        PROBE_EVERY_S unless forced)."""
        if inst.role != "prefill" or inst.url in self.configured:
            return
        known = self.of(inst.url)
        if force or due(known, False, time.monotonic()):
            await probe(engines, inst.url, model, known, timeout)

    def view(self, inst: Instance) -> dict[str, Any]:
        """/status: a P's coordinates (or why they are unknown)."""
        out: dict[str, Any] = {"mode": "nixl-push"}
        if inst.role == "prefill":
            known = self.of(inst.url)
            out["coordinates"] = known.coords.view() if known.coords else None
            out["usable"] = known.coords is not None
            out["reason"] = "" if known.coords else f"push coordinates unknown: {known.why_unknown}"
        return out
