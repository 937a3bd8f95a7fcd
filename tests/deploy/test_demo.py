"""`kvbaton demo` end to end: real redis-server, simulator P and D and router processes."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from router.lifecycle.demo import demo_main
from tests.support.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
TURN_ROW = re.compile(r"^\s+(\d)\s+\d+ ms\s+(\S+)\s+(\d+)\s+(\d+)\s", re.MULTILINE)


def demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router", "demo", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reuse_by_turn(output: str) -> dict[int, str]:
    return {int(turn): reuse for turn, reuse, _prompt, _cached in TURN_ROW.findall(output)}


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


@pytest.mark.timeout(120)
def test_demo_runs_four_turns_with_reuse_from_turn_two(capsys: pytest.CaptureFixture[str]) -> None:
    assert shutil.which("redis-server"), "redis-server is required (make install installs it)"
    port = free_port()
    assert demo_main(["--no-serve", "--port", str(port)]) == 0
    out = capsys.readouterr().out
    assert "private redis-server" in out
    assert "sessions   signed" in out, out
    reuse = reuse_by_turn(out)
    assert list(reuse) == [1, 2, 3, 4], out
    assert reuse[1] == "miss;reason=no-session", out
    assert [reuse[turn] for turn in (2, 3, 4)] == ["hit", "hit", "hit"], out
    cached = [int(row[3]) for row in TURN_ROW.findall(out)]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), out
    assert f"http://127.0.0.1:{port}/v1" in out and "extra_body" in out
    assert port_is_free(port), "the router process is gone"


@pytest.mark.timeout(120)
def test_demo_in_push_mode_keeps_affinity(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_main(["--no-serve", "--port", str(free_port()), "--kv-connector", "nixl-push"]) == 0
    out = capsys.readouterr().out
    assert "push mode" in out
    reuse = reuse_by_turn(out)
    assert reuse[1] == "miss;reason=no-session", out
    assert [reuse[turn] for turn in (2, 3, 4)] == ["miss;reason=push-affinity"] * 3, out
    latency = [int(ms) for ms in re.findall(r"^\s+\d\s+(\d+) ms", out, re.MULTILINE)]
    assert all(ms < latency[0] for ms in latency[1:]), out  # P's prefix cache: the new turn only


@pytest.mark.timeout(120)
def test_demo_without_redis_server_uses_the_memory_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(ROOT / "no-such-dir"))  # children run sys.executable
    assert demo_main(["--no-serve", "--port", str(free_port())]) == 0
    out = capsys.readouterr().out
    assert "--session-store memory" in out
    assert [reuse_by_turn(out)[turn] for turn in (2, 3, 4)] == ["hit", "hit", "hit"], out


def test_demo_reports_a_child_that_cannot_start(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert demo_main(["--no-serve", "--port", str(port), "--redis-url", "redis://x"]) == 1
    out, err = capsys.readouterr()
    assert "kvbaton demo: router exited with status" in err, err
    logs = re.search(r"logs in (\S+)\)", out)
    assert logs is not None and Path(logs[1], "router.log").exists(), "kept for the post-mortem"
    shutil.rmtree(logs[1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_serves_until_a_signal_then_stops_every_process(sig: signal.Signals) -> None:
    port = free_port()
    proc = demo("--port", str(port))
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("Serving."):
            break
    else:
        pytest.fail("the demo ended before serving:\n" + "".join(seen))
    assert not port_is_free(port)
    drive_with_the_sdk(port)
    proc.send_signal(sig)
    out = finish(proc)
    assert proc.returncode == 0, "".join(seen) + out
    assert "Stopping the demo stack" in out
    assert port_is_free(port), "the router still listens after the demo stopped"


def drive_with_the_sdk(port: int) -> None:
    """The serving demo as a user drives it: the OpenAI SDK, two turns, the second a hit."""
    import openai

    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo", max_retries=0)
    model = api.models.list().data[0].id
    messages = [{"role": "user", "content": "Hello from the SDK."}]
    reuse = []
    for _ in range(2):
        raw = api.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=8,  # type: ignore[arg-type]
            extra_body={"conversation_id": "sdk-demo"},
        )
        reuse.append(raw.headers["x-kv-reuse"])
        answer = raw.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    api.close()  # the client hangs up first, so the router's port is not left in TIME_WAIT
    assert reuse == ["miss;reason=no-session", "hit"], reuse
