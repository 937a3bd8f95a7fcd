"""The deploy files, checked without a Docker engine: every compose command parses with the CLI
it runs, env names real settings, URLs and healthchecks hit the ports services listen on."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from router.config import ENV_PREFIX, FLAGS, Settings, load_settings
from router.connectors.nixl_push.coords import parse_spec
from tests.deploy.vllm_serve import BIDIR_NIXL, VLLM_FLAGS
from vllm_sim.config import SimSettings, parse_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
KNOWN_ENV = {ENV_PREFIX + flag.name.upper() for flag in FLAGS} | {ENV_PREFIX + "CONFIG"}


def kind(svc: dict[str, Any]) -> str:
    """router, sim, vllm or redis: which program the service runs."""
    if svc.get("entrypoint") == ["vllm", "serve"]:
        return "vllm"
    if str(svc.get("image", "")).startswith("redis:"):
        return "redis"
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile", svc
    command = svc["command"][0]
    assert command in ("serve", "sim"), f"unknown kvbaton command {command!r}"
    return "router" if command == "serve" else "sim"


def named(wanted: str) -> list[str]:
    return [name for name, svc in SERVICES.items() if kind(svc) == wanted]


# What deploy/.env gives compose (deploy/make-env.sh writes random values of this shape).
DOT_ENV = {"KVBATON_SESSION_SECRET": "s" * 64, "KVBATON_ADMIN_KEY": "a" * 64}
# ${NAME}, ${NAME:-default}, ${NAME:?error}: the interpolation forms the file uses.
VARIABLE = re.compile(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        assert op != ":?", f"${{{name}}} is required: {arg}"
        return arg if op == ":-" else ""

    return VARIABLE.sub(one, value)


def env_of(svc: dict[str, Any], dot_env: dict[str, str] = DOT_ENV) -> dict[str, str]:
    env = svc.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping"
    return {key: interpolate(str(value), dot_env) for key, value in env.items()}


def router_settings(name: str) -> Settings:
    svc = SERVICES[name]
    return load_settings(svc["command"][1:], env=env_of(svc))


def sim_settings(name: str) -> SimSettings:
    return parse_settings(SERVICES[name]["command"][1:])


def vllm_flag(name: str, flag: str) -> str:
    command: list[str] = SERVICES[name]["command"]
    return command[command.index(flag) + 1]


def listen_port(name: str) -> int:
    svc = SERVICES[name]
    port = {
        "router": lambda: router_settings(name).port,
        "sim": lambda: sim_settings(name).port,
        "vllm": lambda: int(vllm_flag(name, "--port")),
        "redis": lambda: 6379,
    }[kind(svc)]()
    return int(port)


def profiles(name: str) -> set[str]:
    return set(SERVICES[name].get("profiles", []))


def test_every_service_is_known_and_both_profiles_exist() -> None:
    kinds = {name: kind(svc) for name, svc in SERVICES.items()}
    default = {kinds[n] for n in SERVICES if not profiles(n)}
    gpu = {kinds[n] for n in SERVICES if "gpu" in profiles(n)}
    push = {kinds[n] for n in SERVICES if "push" in profiles(n)}
    store = {kinds[n] for n in SERVICES if "store" in profiles(n)}
    assert default == {"redis", "router", "sim"}
    assert gpu == {"router", "vllm"}
    assert push == {"router", "sim"}
    assert store == {"router", "sim"}


@pytest.mark.parametrize("name", named("router"))
def test_router_command_and_env_load_as_settings(name: str) -> None:
    settings = router_settings(name)  # the real parser, env reader and validation
    assert settings.host == "0.0.0.0", "reachable from other containers"
    assert settings.session_store == "redis"


def test_every_kvbaton_env_var_names_a_setting() -> None:
    for name, svc in SERVICES.items():
        unknown = {key for key in env_of(svc) if key.startswith(ENV_PREFIX)} - KNOWN_ENV
        assert not unknown, f"{name}: not kvbaton settings: {sorted(unknown)}"


@pytest.mark.parametrize("name", named("sim"))
def test_simulator_command_parses(name: str) -> None:
    settings = sim_settings(name)
    assert settings.host == "0.0.0.0"
    assert settings.role in name
    if settings.kv_connector == "store":  # no side channel: the KV goes through the store
        assert profiles(name) == {"store"}
        return
    assert settings.side_channel_host == name, "the address the other engine pulls from"
    # Push mode has no bidirectional transfer (vllm#46473); pull mode needs it for reuse.
    assert settings.bidirectional == (settings.kv_connector == "nixl")
    assert settings.kv_connector == ("nixl-push" if "push" in profiles(name) else "nixl")
    assert settings.role in name


def test_the_store_profile_shares_one_store_apart_from_the_sessions() -> None:
    router = router_settings("router-store")
    assert router.kv_connector == "store"
    engines = [urlsplit(u).hostname for u in (*router.prefill, *router.decode)]
    assert len(engines) == 4 and all(profiles(str(e)) == {"store"} for e in engines)
    stores = set()
    for name in engines:
        sim = sim_settings(str(name))
        assert sim.kv_connector == "store"
        assert sim.kv_store_save_decode == (sim.role == "decode"), "D writes its answers"
        store = urlsplit(sim.kv_store)
        assert store.hostname in SERVICES and kind(SERVICES[store.hostname]) == "redis"
        assert SERVICES[str(name)]["depends_on"][store.hostname]["condition"] == "service_healthy"
        stores.add(sim.kv_store)
    assert len(stores) == 1, "every engine on the same store"
    assert urlsplit(stores.pop()).path != urlsplit(router.redis_url).path, "not the sessions' db"


def test_push_router_names_the_push_p_coordinates() -> None:
    settings = router_settings("router-push")
    assert settings.kv_connector == "nixl-push"
    (spec,) = settings.prefill_coordinates
    url, coords = parse_spec(spec)
    assert url in settings.prefill
    target = str(urlsplit(url).hostname)
    sim = sim_settings(target)
    assert (coords.engine_id, coords.host, coords.port) == (
        sim.engine_id,
        sim.side_channel_host,
        sim.kv_port,
    )


@pytest.mark.parametrize("name", named("router"))
def test_router_urls_point_at_services_listening_there(name: str) -> None:
    settings = router_settings(name)
    depends = SERVICES[name]["depends_on"]
    targets = [(url, role) for role in ("prefill", "decode") for url in getattr(settings, role)]
    for url, role in [*targets, (settings.redis_url, "redis")]:
        parts = urlsplit(url)
        target = str(parts.hostname)
        assert target in SERVICES, f"{name}: {url} names no service"
        assert parts.port == listen_port(target), f"{name}: {url} but {target} listens elsewhere"
        assert depends[target]["condition"] == "service_healthy", f"{name} -> {target}"
        if role != "redis":
            assert role in target, f"{name}: --{role} {url} points at {target}"


def test_depends_on_targets_exist_are_healthchecked_and_enabled_together() -> None:
    for name, svc in SERVICES.items():
        for target, cond in (svc.get("depends_on") or {}).items():
            assert target in SERVICES, f"{name} depends on a missing service {target}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[target], f"{target} has no healthcheck"
            # A service always enabled cannot wait for one that only a profile enables.
            assert not profiles(target) or profiles(target) & profiles(name), (name, target)


def test_healthchecks_probe_health_on_the_listening_port() -> None:
    for name, svc in SERVICES.items():
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        urls = re.findall(r"http://127\.0\.0\.1:(\d+)(/\w+)", test)
        if kind(svc) == "router":
            assert "healthcheck" not in svc, "the image's HEALTHCHECK reads KVBATON_PORT"
            continue
        if kind(svc) == "redis":
            assert "redis-cli ping" in test
            continue
        assert urls == [(str(listen_port(name)), "/health")], f"{name}: {test}"


def test_published_router_ports_match_listen_ports_on_loopback() -> None:
    published = []
    for name in named("router"):
        for mapping in SERVICES[name]["ports"]:
            address, host_port, port = str(mapping).split(":")
            assert address == "127.0.0.1", f"{name}: the demo stack serves this host only"
            assert int(port) == listen_port(name)
            published.append(host_port)
    others = [n for n in SERVICES if kind(SERVICES[n]) != "router" and "ports" in SERVICES[n]]
    assert not others, f"only the routers publish ports: {others}"
    assert len(published) == len(set(published)), "two services publish the same host port"


@pytest.mark.parametrize("name", named("router"))
def test_routers_sign_sessions_with_the_secret_of_the_env_file(name: str) -> None:
    """KVBATON_SESSION_SECRET comes from deploy/.env (or the shell) and is required: without it
    compose refuses to start, rather than running unsigned sessions."""
    raw = SERVICES[name]["environment"]
    assert raw["KVBATON_SESSION_SECRET"].startswith("${KVBATON_SESSION_SECRET:?")
    with pytest.raises(AssertionError, match="required"):
        env_of(SERVICES[name], {})
    settings = router_settings(name)
    assert settings.session_secrets == (DOT_ENV["KVBATON_SESSION_SECRET"],)
    assert settings.admin_key == DOT_ENV["KVBATON_ADMIN_KEY"]


@pytest.mark.e2e
def test_make_env_writes_random_secrets_once_and_is_git_ignored(tmp_path: Path) -> None:
    path = tmp_path / ".env"

    def written() -> dict[str, str]:
        subprocess.run(["bash", str(DEPLOY / "make-env.sh"), str(path)], check=True, timeout=30)
        return dict(line.split("=", 1) for line in path.read_text().splitlines())

    first = written()
    assert set(first) == set(DOT_ENV)
    assert all(re.fullmatch(r"[0-9a-f]{64}", value) for value in first.values()), first
    assert written() == first, "an existing file keeps its secrets"
    path.write_text("KVBATON_ADMIN_KEY=mine\n")
    again = written()
    assert again["KVBATON_ADMIN_KEY"] == "mine"
    assert again["KVBATON_SESSION_SECRET"] != first["KVBATON_SESSION_SECRET"], "random"
    assert path.stat().st_mode & 0o077 == 0, "readable by its owner only"
    assert "deploy/.env" in (ROOT / ".gitignore").read_text().split()


@pytest.mark.parametrize("name", named("vllm"))
def test_gpu_engines_run_bidirectional_nixl(name: str) -> None:
    svc = SERVICES[name]
    command: list[str] = svc["command"]
    flags = {arg for arg in command if arg.startswith("--")}
    assert flags <= VLLM_FLAGS, f"{name}: unexpected vllm serve flags {flags - VLLM_FLAGS}"
    assert "--enable-prompt-tokens-details" in flags, "cached_tokens in usage"
    assert "--enable-scale-out" in flags, "/v1/responses/render for Responses verification"
    assert json.loads(vllm_flag(name, "--kv-transfer-config")) == BIDIR_NIXL
    env = env_of(svc)
    address = svc["networks"]["default"]["ipv4_address"]
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == address, "advertised and bound side channel"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert profiles(name) == {"gpu"}


def test_gpu_engines_use_distinct_gpus_addresses_and_ports() -> None:
    engines = [SERVICES[n] for n in named("vllm")]
    gpus = [
        e["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0] for e in engines
    ]
    side = [env_of(e)["VLLM_NIXL_SIDE_CHANNEL_PORT"] for e in engines]
    assert len(engines) == 2 and len(set(gpus)) == 2 and len(set(side)) == 2


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_runs_kvbaton_as_non_root_with_a_healthcheck() -> None:
    steps = dockerfile()
    last_stage = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    ops = dict(last_stage)
    assert last_stage[0][1].startswith("python:3.11-slim")
    assert ops["USER"].split(":")[0] not in ("root", "0")
    assert "/health" in ops["HEALTHCHECK"] and "KVBATON_PORT" in ops["HEALTHCHECK"]
    assert ops["EXPOSE"] == "8000"
    assert json.loads(ops["ENTRYPOINT"]) == ["kvbaton"]
    assert json.loads(ops["CMD"]) == ["serve"]
    assert "KVBATON_HOST=0.0.0.0" in ops["ENV"]


def test_dockerfile_copies_paths_that_exist_and_are_not_ignored() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for op, args in dockerfile():
        if op != "COPY" or args.startswith("--from"):
            continue
        for source in args.split()[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: missing"
            assert f"!{source}" in ignore, f"COPY {source}: excluded by the .dockerignore"


def test_settings_file_example_loads() -> None:
    settings = load_settings(["--config", str(DEPLOY / "router.example.toml")], env={})
    assert settings.prefill and settings.decode
    assert settings.handle_ttl < 480, "below vLLM's decoder_kv_blocks_ttl"
