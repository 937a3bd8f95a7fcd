"""deploy/k8s: every overlay rendered with `kubectl kustomize` and checked offline against the
Kubernetes schemas (kubernetes-validate; the ServiceMonitor CRD against a schema of our own in
schemas/), then wired as the router needs: probes, env that names real settings, Services
that select pods and target their ports, engines that advertise a reachable side channel."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.config import ENV_PREFIX, FLAGS, load_settings
from router.errors import ConfigError
from router.signing import signed
from tests.deploy.vllm_serve import BIDIR_NIXL, VLLM_FLAGS
from vllm_sim.config import parse_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
K8S_VERSION = "1.32.0"  # the oldest API version the manifests target
SERVICEMONITOR = json.loads((Path(__file__).parent / "schemas" / "servicemonitor.json").read_text())
KNOWN_ENV = {ENV_PREFIX + flag.name.upper() for flag in FLAGS}
Doc = dict[str, Any]


def kubectl() -> str:
    exe = shutil.which("kubectl")
    if exe is None:
        message = "kubectl is not installed (it renders deploy/k8s with `kubectl kustomize`)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return exe


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    exe = kubectl()
    out = {}
    for overlay in OVERLAYS:
        text = subprocess.run(
            [exe, "kustomize", str(K8S / "overlays" / overlay)],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        out[overlay] = [d for d in yaml.safe_load_all(text) if d]
    return out


def validate(doc: Doc) -> None:
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        jsonschema.validate(doc, SERVICEMONITOR)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def containers(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    for d in docs:
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


def ports(container: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def pod_labels(deploy: Doc) -> dict[str, str]:
    labels: dict[str, str] = deploy["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def router_env(docs: list[Doc]) -> dict[str, str]:
    """The router's environment: its ConfigMap, then its env entries (a Secret's as <secret>)."""
    deploy = find(docs, "Deployment", "kvbaton-router")
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for ref in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", ref["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", f"<{json.dumps(e.get('valueFrom'))}>")
    return env


def test_there_are_sim_and_gpu_overlays() -> None:
    assert {"sim", "gpu", "gpu-external-redis"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_schema(rendered: dict[str, list[Doc]], overlay: str) -> None:
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"} <= kinds
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("namespace", "kvbaton") == "kvbaton"


def test_the_validators_refuse_broken_objects(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["sim"]
    deploy = copy.deepcopy(find(docs, "Deployment", "kvbaton-router"))
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deploy)
    monitor = copy.deepcopy(find(docs, "ServiceMonitor", "kvbaton-router"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_replicas_probes_resources_and_disruption_budget(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    deploy = find(docs, "Deployment", "kvbaton-router")
    assert deploy["spec"]["replicas"] >= 2
    spec = deploy["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports(c)
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert c["args"] == ["serve"]
    env = router_env(docs)
    assert spec["terminationGracePeriodSeconds"] > float(env["KVBATON_SHUTDOWN_GRACE"])
    assert int(env["KVBATON_PORT"]) == ports(c)["http"]
    pdb = find(docs, "PodDisruptionBudget", "kvbaton-router")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(deploy))
    assert pdb["spec"].get("maxUnavailable", 0) < deploy["spec"]["replicas"]
    monitor = find(docs, "ServiceMonitor", "kvbaton-router")
    service = find(docs, "Service", "kvbaton-router")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_env_loads_as_settings_and_points_at_headless_engine_services(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    env = router_env(docs)
    assert set(env) <= KNOWN_ENV, set(env) - KNOWN_ENV
    settings = load_settings([], env={k: v for k, v in env.items() if not v.startswith("<")})
    assert settings.resolve_dns and settings.session_store == "redis"
    assert settings.host == "0.0.0.0"
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for url in (*settings.prefill, *settings.decode):
        parts = urlsplit(url)
        svc = services[str(parts.hostname)]
        assert svc["spec"]["clusterIP"] == "None", f"{url}: one instance per pod needs headless"
        assert parts.port in {p["port"] for p in svc["spec"]["ports"]}
    redis_url = env["KVBATON_REDIS_URL"]
    if overlay == "gpu-external-redis":
        assert "secretKeyRef" in redis_url and "kvbaton-redis" not in services
    else:
        assert urlsplit(redis_url).hostname in services


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_pods_and_target_their_ports(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for svc in (d for d in docs if d["kind"] == "Service"):
        backing = [d for d in deployments if selects(svc["spec"]["selector"], pod_labels(d))]
        assert len(backing) == 1, svc["metadata"]["name"]
        named = {n for c in backing[0]["spec"]["template"]["spec"]["containers"] for n in ports(c)}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in named, (svc["metadata"]["name"], p)


def sim_argv(container: Doc) -> list[str]:
    args: list[str] = container["args"]
    assert args[0] == "sim"
    return [a.replace("$(POD_IP)", "10.1.2.3") for a in args[1:]]


def test_sim_engines_parse_and_advertise_their_pod_ip(rendered: dict[str, list[Doc]]) -> None:
    engines = [(d, c) for d, c in containers(rendered["sim"]) if c.get("args", [""])[0] == "sim"]
    assert {pod_labels(d)["app.kubernetes.io/component"] for d, _ in engines} == {
        "prefill",
        "decode",
    }
    for deploy, c in engines:
        sim = parse_settings(sim_argv(c))
        assert sim.role == pod_labels(deploy)["app.kubernetes.io/component"]
        assert sim.port == ports(c)["http"] and sim.kv_port == ports(c)["kv"]
        assert sim.side_channel_host == "10.1.2.3"  # from status.podIP
        assert "--engine-id" not in c["args"]  # never fixed (docs/troubleshooting.md)
        (pod_ip,) = [e for e in c["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("overlay", ["gpu", "gpu-external-redis"])
def test_vllm_engines_run_bidirectional_nixl_with_a_pod_ip_side_channel(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    config = find(docs, "ConfigMap", "kvbaton-vllm")["data"]
    assert json.loads(config["kv-transfer-config"]) == BIDIR_NIXL
    engines = [(d, c) for d, c in containers(docs) if c["image"].startswith("vllm/")]
    assert len(engines) == 2
    plain = {k: v for k, v in router_env(docs).items() if not v.startswith("<")}
    assert load_settings([], env=plain).handle_ttl < 480  # below vLLM's decoder_kv_blocks_ttl
    for _, c in engines:
        assert c["command"] == ["vllm", "serve"]
        flags = {a for a in c["args"] if a.startswith("--")}
        assert flags <= VLLM_FLAGS, flags - VLLM_FLAGS
        args = c["args"]
        assert int(args[args.index("--port") + 1]) == ports(c)["http"]
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports(c)["kv"]
        ref = env["KV_TRANSFER_CONFIG"]["valueFrom"]["configMapKeyRef"]
        assert (ref["name"], ref["key"]) == ("kvbaton-vllm", "kv-transfer-config")
        assert args[args.index("--kv-transfer-config") + 1] == "$(KV_TRANSFER_CONFIG)"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_signs_sessions_with_a_secret_the_operator_creates(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    deploy = find(docs, "Deployment", "kvbaton-router")
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    (entry,) = [e for e in c["env"] if e["name"] == "KVBATON_SESSION_SECRET"]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("kvbaton-session", "secret")
    assert not ref.get("optional"), "a missing Secret must keep the router from starting"
    assert not [d for d in docs if d["kind"] == "Secret"], "the secret is never in the manifests"
    assert "create secret generic kvbaton-session" in (K8S / "README.md").read_text()
    plain = {k: v for k, v in router_env(docs).items() if not v.startswith("<")}
    with pytest.raises(ConfigError, match="KVBATON_SESSION_SECRET"):
        signed(load_settings([], env=plain))  # without the Secret's value: refuses to start
    secret = {**plain, "KVBATON_SESSION_SECRET": "s" * 43}
    assert signed(load_settings([], env=secret)).session_secrets == ("s" * 43,)
