"""The compose stacks for real: deploy/Dockerfile's image under podman-compose, used from the
host as a user would (OpenAI SDK, redis-cli in the Redis container, /metrics, the admin API),
and the Kubernetes overlays checked against the same image. `make test-compose` runs this
(tests/compose/tier.sh builds the images first); elsewhere it skips."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import yaml

from harness.chat import Message, chat_turn, client, get_json, post, reference_answer
from harness.metrics import scrape, total
from harness.procs import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
COMPOSE: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
PROJECT = "kvbaton-test"
IMAGE = COMPOSE["x-kvbaton-image"]["image"]
ENABLED = os.environ.get("KVBATON_TEST_COMPOSE") == "1"
PODMAN_COMPOSE = os.environ.get("KVBATON_PODMAN_COMPOSE", "podman-compose")
START_TIMEOUT = 90.0  # every container healthy; about 5 s when the image serves

pytestmark = [
    pytest.mark.skipif(not ENABLED, reason="`make test-compose` runs the container stack"),
    pytest.mark.timeout(240),
]


def podman(*args: str, check: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode:
        raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr[-2000:]}")
    return done.stdout


def compose(*args: str, timeout: float = 180) -> None:
    command = [PODMAN_COMPOSE, "-p", PROJECT, "-f", str(COMPOSE_FILE), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(command)}: {done.returncode}\n{done.stderr[-3000:]}"


def containers() -> dict[str, str]:
    """service -> container name, for this project's containers (running or not)."""
    out = podman(
        "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
        "--format", '{{.Names}} {{index .Labels "com.docker.compose.service"}}',
    )  # fmt: skip
    return {svc: name for name, svc in (line.split() for line in out.splitlines() if line)}


def state(name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(podman("inspect", "--type", "container", name))
    return dict(found[0]["State"])


def logs(name: str, lines: int = 30) -> str:
    done = subprocess.run(
        ["podman", "logs", "--tail", str(lines), name], capture_output=True, text=True, check=False
    )
    return (done.stdout + done.stderr)[-3000:]


def healthy(name: str) -> bool:
    """The container's own healthcheck (the image's HEALTHCHECK or the compose file's), run
    now: podman runs no healthcheck timers without systemd, so nothing else would."""
    run = subprocess.run(["podman", "healthcheck", "run", name], capture_output=True, check=False)
    return run.returncode == 0


def wait_healthy(services: list[str]) -> dict[str, str]:
    """Every service's container runs and passes its healthcheck; a container that exited
    fails at once, with its logs."""
    names = containers()
    missing = [s for s in services if s not in names]
    assert not missing, f"no container for {missing}: {names}"
    deadline = time.monotonic() + START_TIMEOUT
    pending = list(services)
    while pending:
        for svc in list(pending):
            st = state(names[svc])
            assert st["Status"] == "running", (
                f"{svc} is {st['Status']} (exit code {st['ExitCode']}):\n{logs(names[svc])}"
            )
            if healthy(names[svc]):
                pending.remove(svc)
        if pending and time.monotonic() > deadline:
            output = "\n".join(logs(names[s]) for s in pending)
            raise AssertionError(f"not healthy after {START_TIMEOUT:.0f} s: {pending}\n{output}")
        time.sleep(0.5)
    return names


def env_file() -> dict[str, str]:
    """deploy/.env, which tier.sh (deploy/make-env.sh) wrote."""
    pairs = (line.split("=", 1) for line in (DEPLOY / ".env").read_text().splitlines())
    return {key: value for key, value in (p for p in pairs if len(p) == 2)}


def with_dependencies(service: str) -> list[str]:
    return [*COMPOSE["services"][service].get("depends_on", {}), service]


def published(service: str) -> str:
    """The router's URL on the host, from the compose file's `ports`."""
    host, port, _ = str(COMPOSE["services"][service]["ports"][0]).split(":")
    return f"http://{host}:{port}"


class Stack:
    def __init__(self, router: str, names: dict[str, str]) -> None:
        self.router = router
        self.url = published(router)
        self.names = names

    def api(self, **kw: Any) -> openai.OpenAI:
        return client(self.url + "/v1", **kw)

    def redis_cli(self, *args: str) -> str:
        return podman("exec", self.names["redis"], "redis-cli", *args)

    def engine_metric(self, service: str, name: str, **labels: str) -> float:
        """A sample of an engine's /metrics, read inside its container (the engines publish
        no port)."""
        command = COMPOSE["services"][service]["command"]
        port = command[command.index("--port") + 1]
        get = (
            "import urllib.request as u;"
            f"print(u.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
        )
        return total(podman("exec", self.names[service], "python", "-c", get), name, **labels)


def serving(name: str, url: str, timeout: float = 60) -> None:
    """The container answers url with 200; it must not exit meanwhile (its logs say why)."""
    deadline = time.monotonic() + timeout
    while True:
        st = state(name)
        assert st["Status"] == "running", f"{name} exited ({st['ExitCode']}):\n{logs(name)}"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if int(reply.status) == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url}: no 200 within {timeout} s\n{logs(name)}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def reference() -> Iterator[str]:
    """A from-scratch engine: the image's simulator, no connector, on a free loopback port."""
    port, name = free_port(), f"{PROJECT}-reference"
    podman("rm", "-f", name, check=False)
    try:
        podman(
            "run", "-d", "--no-healthcheck", "--name", name, "-p", f"127.0.0.1:{port}:8200",
            IMAGE, "sim", "--role", "decode", "--host", "0.0.0.0", "--port", "8200",
        )  # fmt: skip
        serving(name, f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        podman("rm", "-f", name, check=False)


def assert_free(url: str) -> None:
    """Nothing holds the router's host port: not a process, not a port forward left by an
    earlier stack (connecting then fails with "no route to host", not "refused")."""
    parts = urlsplit(url)
    with socket.socket() as sock:
        sock.settimeout(2)
        code = sock.connect_ex((str(parts.hostname), int(str(parts.port))))
    assert code == errno.ECONNREFUSED, f"{url} is taken: {os.strerror(code)}"


def bring_up(profile: str | None, router: str) -> Iterator[Stack]:
    args = ["--profile", profile] if profile else []
    assert_free(published(router))
    try:
        compose(*args, "up", "-d", router)
        names = wait_healthy(with_dependencies(router))
        # podman-compose with Podman 4 does not wait for the healthchecks before it starts
        # the router: it may start before its engines and take them in a health round later.
        serving(names[router], published(router) + "/ready", timeout=START_TIMEOUT)
        wait_until(lambda: not get_json(published(router) + "/ready")["degraded"], "Redis")
        yield Stack(router, names)
    finally:
        compose(*args, "down", "-t", "10")
        assert not containers(), "compose down left containers"


def chat(stack: Stack, messages: list[Message], cid: str, ref: str, **kw: Any) -> str:
    """One turn through the router; the answer must be the reference engine's. Returns
    X-KV-Reuse and adds the answer to `messages`."""
    with stack.api() as api:
        answer, reuse, _ = chat_turn(api, messages, cid=cid, **kw)
    assert answer == reference_answer(ref, messages, 24), f"{cid}: {reuse}"
    messages.append({"role": "assistant", "content": answer})
    return reuse


def conversation(
    stack: Stack, ref: str, turns: int, stream_last: bool = False
) -> tuple[str, list[str]]:
    """A conversation of `turns` turns (the last one streamed, with `stream_last`): its id
    and each turn's X-KV-Reuse."""
    cid = f"compose-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "system", "content": "You answer about tea."}]
    reuses = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"Question {turn}: which tea for rain?"})
        reuses.append(chat(stack, messages, cid, ref, stream=stream_last and turn == turns))
    return cid, reuses


# ---- the image, and the Kubernetes overlays that run it ----


def image_config() -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(podman("image", "inspect", IMAGE))
    return dict(found[0]["Config"])


def test_the_image_runs_kvbaton_as_its_unprivileged_user() -> None:
    config = image_config()
    assert config["User"] == "10001"
    assert config["Entrypoint"] == ["kvbaton"] and config["Cmd"] == ["serve"]
    assert set(config["ExposedPorts"]) == {"8000/tcp"}
    who = podman("run", "--rm", "--no-healthcheck", "--entrypoint", "id", IMAGE, "-u")
    assert who.strip() == "10001"


def rendered_overlays() -> dict[str, list[dict[str, Any]]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl renders deploy/k8s (`kubectl kustomize`)"
    out = {}
    for overlay in sorted((DEPLOY / "k8s" / "overlays").iterdir()):
        text = subprocess.run(
            [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True
        ).stdout
        out[overlay.name] = [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def kvbaton_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], Any]]:
    """(container, pod spec) of every container that runs the kvbaton image."""
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            for container in pod["containers"]:
                if container["image"].split(":")[0].endswith("kvbaton"):
                    yield container, pod


def container_env(container: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, str]:
    """Its env, its ConfigMaps' data included."""
    env = {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
        env.update({k: str(v) for k, v in cm["data"].items()})
    return env


class Usage:
    """What `kvbaton COMMAND --help` in the image lists: its flags and KVBATON_* variables."""

    def __init__(self, command: str) -> None:
        help_flag = "--help=all" if command == "serve" else "--help"  # serve's --help: a summary
        text = podman("run", "--rm", "--no-healthcheck", IMAGE, command, help_flag)
        self.flags = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text))
        self.env = set(re.findall(r"\bKVBATON_\w+", text)) - {"KVBATON_"}
        assert len(self.flags) > 10, text


# `KVBATON_CONFIG` names the settings file (not a flag's variable); the docs' placeholder.
NOT_SETTINGS = {"KVBATON_CONFIG", "KVBATON_SOME_FLAG"}


def test_k8s_overlays_name_what_the_image_has() -> None:
    """Every kvbaton container of every overlay: the image is the one built, its command is
    one the entry point has, each flag and KVBATON_* variable is one `--help` lists, the
    ports are the ones it listens on, and the user is the image's."""
    usage = {cmd: Usage(cmd) for cmd in ("serve", "sim")}
    config = image_config()
    seen = set()
    for overlay, docs in rendered_overlays().items():
        for container, pod in kvbaton_containers(docs):
            where = f"{overlay}/{container['name']}"
            assert container["image"] == IMAGE, where
            # no `command`: the image's ENTRYPOINT (kvbaton) runs the args
            assert "command" not in container, where
            argv = container["args"]
            assert argv[0] in usage, f"{where}: {argv}"
            flags = {a.split("=")[0] for a in argv if a.startswith("--")}
            assert flags <= usage[argv[0]].flags, f"{where}: {flags - usage[argv[0]].flags}"
            env = container_env(container, docs)
            names = {n for n in env if n.startswith("KVBATON_")} - NOT_SETTINGS
            assert names <= usage["serve"].env, f"{where}: {names - usage['serve'].env}"
            ports = {p.get("name"): p["containerPort"] for p in container["ports"]}
            if argv[0] == "serve":
                assert ports["http"] == int(env.get("KVBATON_PORT", "8000"))
                assert f"{ports['http']}/tcp" in config["ExposedPorts"], where
            else:
                assert ports["http"] == int(argv[argv.index("--port") + 1]), where
                assert ports["kv"] == int(argv[argv.index("--kv-port") + 1]), where
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                if probe in container:
                    assert container[probe]["httpGet"]["path"] in ("/health", "/ready"), where
            assert str(pod["securityContext"]["runAsUser"]) == config["User"], where
            seen.add(argv[0])
    assert seen == {"serve", "sim"}


def test_the_docs_name_variables_the_image_reads() -> None:
    env = Usage("serve").env
    for doc in ("deploy/README.md", "deploy/k8s/README.md", "docs/containers.md"):
        named = set(re.findall(r"\bKVBATON_[A-Z0-9_]*[A-Z0-9]", (ROOT / doc).read_text()))
        assert named - NOT_SETTINGS <= env, f"{doc}: {named - NOT_SETTINGS - env}"


def k8s_router() -> tuple[dict[str, Any], dict[str, str]]:
    docs = rendered_overlays()["sim"]
    ((container, pod),) = [(c, p) for c, p in kvbaton_containers(docs) if c["name"] == "router"]
    return {"pod": pod, "container": container}, container_env(container, docs)


# ---- the default stack: redis, two simulators and the router on :8000 ----


@pytest.fixture(scope="class")
def default_stack() -> Iterator[Stack]:
    yield from bring_up(None, "router")


@pytest.mark.usefixtures("default_stack")
class TestDefaultStack:
    def test_every_container_is_healthy_and_the_router_ready(self, default_stack: Stack) -> None:
        ready = get_json(default_stack.url + "/ready")
        assert ready["store"] == "ok" and not ready["degraded"], ready
        assert get_json(default_stack.url + "/health")
        models = get_json(default_stack.url + "/v1/models")
        assert [m["id"] for m in models["data"]] == ["sim-model"]

    def test_a_conversation_hits_from_turn_two_with_exact_answers(
        self, default_stack: Stack, reference: str
    ) -> None:
        # As shipped, an idle D runs a later turn alone (`hit;via=decode`, its own prefix
        # cache); a busier one has P pull its KV (`hit`). Either way the answers are exact.
        _, reuses = conversation(default_stack, reference, 3, stream_last=True)
        assert reuses[0] == "miss;reason=no-session", reuses
        assert all(r in ("hit", "hit;via=decode") for r in reuses[1:]), reuses

    def test_the_session_is_signed_and_readable_with_redis_cli(
        self, default_stack: Stack, reference: str
    ) -> None:
        cid, _ = conversation(default_stack, reference, 2)
        keys = default_stack.redis_cli("--scan", "--pattern", f"kvbaton:conv:{{*:{cid}}}").split()
        assert len(keys) == 1, keys
        raw = default_stack.redis_cli("HGETALL", keys[0]).splitlines()
        fields = dict(zip(raw[::2], raw[1::2], strict=True))
        assert fields["turn"] == "2", fields
        assert fields["prefill"] == "http://prefill-sim:8100"
        assert fields["decode"] == "http://decode-sim:8200"
        # a decode-plan turn leaves no handle; a pulled one D's
        if fields["kv_transfer_params"]:
            assert json.loads(fields["kv_transfer_params"])["remote_engine_id"] == "decode-sim"
        assert fields["mac"], "the routers sign sessions (KVBATON_SESSION_SECRET)"
        assert 0 < int(default_stack.redis_cli("TTL", keys[0])) <= 3600

    def test_metrics_count_the_turns_and_hits(self, default_stack: Stack, reference: str) -> None:
        before = scrape(default_stack.url)
        conversation(default_stack, reference, 2)
        after = scrape(default_stack.url)
        for name, labels, grew in [
            ("kvbaton_requests_total", {"route": "/v1/chat/completions", "status": "200"}, 2),
            ("kvbaton_kv_reuse_total", {"outcome": "hit"}, 1),
        ]:
            delta = total(after, name, **labels) - total(before, name, **labels)
            assert delta == grew, (name, labels, delta)

    def test_the_admin_api_with_the_key_from_the_env_file(
        self, default_stack: Stack, reference: str
    ) -> None:
        url, key = default_stack.url + "/admin", env_file()["KVBATON_ADMIN_KEY"]
        auth = {"Authorization": f"Bearer {key}"}
        denied = post(url + "/instances", method="GET", headers={})
        assert denied.status == 401 and denied.json()["error"]["code"] == "invalid_admin_key"
        pool = post(url + "/instances", method="GET", headers=auth).json()
        assert "http://decode-sim:8200" in json.dumps(pool), pool
        cid, _ = conversation(default_stack, reference, 1)
        key_name = default_stack.redis_cli("--scan", "--pattern", f"kvbaton:conv:{{*:{cid}}}")
        tenant = key_name.strip().split("{", 1)[1].split(":", 1)[0]
        one = post(f"{url}/conversations/{cid}?tenant={tenant}", method="GET", headers=auth)
        assert one.status == 200 and one.json()["turn"] == 1, one.body
        gone = post(f"{url}/conversations/{cid}?tenant={tenant}", method="DELETE", headers=auth)
        assert gone.status < 300, gone.body
        with default_stack.api() as api:
            turn = chat_turn(api, [{"role": "user", "content": "again"}], cid=cid)
        assert turn.reuse == "miss;reason=no-session"

    def test_bad_input_gets_an_openai_error_with_the_request_id(self, default_stack: Stack) -> None:
        reply = post(default_stack.url + "/v1/chat/completions", raw=b"{not json")
        assert reply.status == 400, reply.body
        assert set(reply.json()["error"]) >= {"message", "type", "code"}
        assert reply.headers["x-request-id"]

    def test_the_k8s_router_settings_run_in_the_image_as_k8s_runs_it(
        self, default_stack: Stack
    ) -> None:
        """The sim overlay's router container: its ConfigMap env (engines and Redis pointed at
        this stack's services), its security context (read-only root, no capabilities, its
        user), its probes' paths."""
        spec, env = k8s_router()
        env |= {
            "KVBATON_PREFILL": "http://prefill-sim:8100",
            "KVBATON_DECODE": "http://decode-sim:8200",
            "KVBATON_REDIS_URL": "redis://redis:6379/5",
            "KVBATON_SESSION_SECRET": env_file()["KVBATON_SESSION_SECRET"],
        }
        sc, pod = spec["container"]["securityContext"], spec["pod"]["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"]
        port, name = free_port(), f"{PROJECT}-k8s-router"
        network = f"{PROJECT}_default"
        args = ["run", "-d", "--no-healthcheck", "--name", name, "--network", network]
        args += ["--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL"]
        args += ["--user", f"{pod['runAsUser']}:{pod['runAsGroup']}"]
        args += ["--security-opt", "no-new-privileges", "-p", f"127.0.0.1:{port}:8000"]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        try:
            podman(*args, IMAGE, *spec["container"]["args"])
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = spec["container"][probe]["httpGet"]["path"]
                serving(name, f"http://127.0.0.1:{port}{path}", timeout=30)
            assert get_json(f"http://127.0.0.1:{port}/ready")["status"] == "ready", logs(name)
        finally:
            podman("rm", "-f", "-t", "5", name, check=False)

    def test_podman_stop_drains_the_turn_in_flight(self, default_stack: Stack) -> None:
        """SIGTERM (podman stop, default 10 s grace): the router stops taking turns and
        finishes the one in flight (2000 tokens at 2 ms each on D), then exits 0."""
        name = default_stack.names["router"]
        result: dict[str, Any] = {}

        def long_turn() -> None:
            with default_stack.api(timeout=30) as api:
                out = api.chat.completions.create(
                    model="sim-model",
                    messages=[{"role": "user", "content": "Tell me a long story."}],
                    max_tokens=2000,
                )
            result["usage"] = out.usage

        thread = threading.Thread(target=long_turn)
        thread.start()
        wait_until(
            lambda: default_stack.engine_metric("decode-sim", "vllm:num_requests_running") >= 1,
            "the turn running on D",
        )
        podman("stop", name)  # returns once the container exited, or killed it after 10 s
        thread.join(10)
        assert result.get("usage") is not None, logs(name)
        assert result["usage"].completion_tokens == 2000
        # 0: it exited by itself after the drain (a kill after the 10 s would be 137)
        assert state(name)["ExitCode"] == 0, logs(name)
        assert "1 requests in flight" in logs(name), logs(name)


# ---- the push and store profiles ----


@pytest.fixture(scope="class")
def push_stack() -> Iterator[Stack]:
    yield from bring_up("push", "router-push")


class TestPushProfile:
    def test_turns_keep_affinity_and_answer_exactly(
        self, push_stack: Stack, reference: str
    ) -> None:
        _, reuses = conversation(push_stack, reference, 3)
        assert reuses == ["miss;reason=no-session", *["miss;reason=push-affinity"] * 2]


@pytest.fixture(scope="class")
def store_stack() -> Iterator[Stack]:
    yield from bring_up("store", "router-store")


class TestStoreProfile:
    def test_turns_read_the_store_and_answer_exactly(
        self, store_stack: Stack, reference: str
    ) -> None:
        _, reuses = conversation(store_stack, reference, 3)
        assert reuses == ["miss;reason=no-session", "hit;via=store", "hit;via=store"]
        keys = store_stack.redis_cli("-n", "3", "DBSIZE")
        assert int(keys) > 0, "the engines' KV is in the shared store (redis db 3)"
        assert urlsplit(store_stack.url).port == 8003
