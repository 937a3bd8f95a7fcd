"""`kvbaton demo` end to end: real redis-server, simulator P and D and router processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from harness.procs import free_port, output_until
from harness.waiting import scaled
from router.lifecycle.demo import demo_main

ROOT = Path(__file__).resolve().parents[2]
# turn, prompt, TTFT and computed with reuse, X-KV-Reuse, then TTFT and computed without.
TURN_ROW = re.compile(
    r"^\s+(\d)\s+(\d+)\s+(\d+) ms\s+(\d+)\s+(\S+)\s+\|\s+(\d+) ms\s+(\d+)\s", re.MULTILINE
)


class Row(NamedTuple):
    turn: int
    prompt: int
    ttft: int
    computed: int
    reuse: str
    ttft_alone: int
    computed_alone: int


def rows(output: str) -> list[Row]:
    return [
        Row(int(t), int(p), int(ms), int(c), reuse, int(ms2), int(c2))
        for t, p, ms, c, reuse, ms2, c2 in TURN_ROW.findall(output)
    ]


def demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "router", "demo", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reuse_by_turn(output: str) -> dict[int, str]:
    return {row.turn: row.reuse for row in rows(output)}


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=scaled(100))
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
    first, *later = rows(out)
    assert first.computed == first.prompt and first.computed_alone == first.prompt, out
    # With reuse P computes the new question only; alone, also D's previous answer.
    assert all(r.computed < r.computed_alone < r.prompt for r in later), out
    assert all(r.ttft < first.ttft for r in later), out
    summary = re.search(
        r"^Turns 2-4 \(hit\): (\d+) prompt tokens computed with reuse, (\d+) "
        r"without; time to first token \d+ ms with reuse, \d+ ms without",
        out,
        re.MULTILINE,
    )
    assert summary is not None, out
    assert int(summary[1]) == sum(r.computed for r in later), out
    assert int(summary[2]) == sum(r.computed_alone for r in later), out
    assert "The router is at" not in out and "Try it" not in out, "no invitation: it is gone"
    assert port_is_free(port), "the router process is gone"


@pytest.mark.timeout(120)
def test_demo_in_push_mode_keeps_affinity(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_main(["--no-serve", "--port", str(free_port()), "--kv-connector", "nixl-push"]) == 0
    out = capsys.readouterr().out
    assert "push mode" in out
    reuse = reuse_by_turn(out)
    assert reuse[1] == "miss;reason=no-session", out
    assert [reuse[turn] for turn in (2, 3, 4)] == ["miss;reason=push-affinity"] * 3, out
    first, *later = rows(out)
    assert all(r.ttft < first.ttft for r in later), out  # P's prefix cache: the new turn only


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
    seen = output_until(proc, "Serving.")
    assert not port_is_free(port)
    drive_with_the_sdk(port)
    run_the_printed_examples(seen, port)
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
            # Past the demo P's kv_recompute_threshold (64, vLLM's default): a shorter answer
            # is not read from D (P recomputes it: `hit;via=prefill-cache`).
            max_tokens=96,  # type: ignore[arg-type]
            extra_body={"conversation_id": "sdk-demo"},
        )
        reuse.append(raw.headers["x-kv-reuse"])
        answer = raw.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    api.close()  # the client hangs up first, so the router's port is not left in TIME_WAIT
    assert reuse == ["miss;reason=no-session", "hit"], reuse


def printed_block(output: str, first: str) -> str:
    """The block the demo printed from the line starting with `first` to the next blank line,
    without the two spaces it is indented by."""
    lines = output.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("  " + first))
    end = lines.index("", start)
    return "\n".join(line.removeprefix("  ") for line in lines[start:end]) + "\n"


def run_the_printed_examples(output: str, port: int) -> None:
    """What the demo prints to try it runs as printed, in a shell given its export line: the
    curl and the SDK example continue one conversation (one tenant, one session), and the
    command it prints shows the scripted conversation."""
    exports = re.search(r"^  export (.+)$", output, re.MULTILINE)
    assert exports is not None, output
    env = dict(os.environ, **dict(pair.split("=", 1) for pair in exports[1].split()))
    assert env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{port}/v1", exports[0]
    assert env["REDIS_URL"].startswith("redis://127.0.0.1:"), exports[0]
    curl = printed_block(output, "curl -si")
    done = subprocess.run(["bash", "-c", curl], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.startswith("HTTP/1.1 200"), done.stdout
    assert "x-kv-reuse: miss;reason=no-session" in done.stdout.lower(), done.stdout
    sdk = printed_block(output, "from openai import OpenAI")
    subprocess.run([sys.executable, "-c", sdk], env=env, check=True, timeout=30)
    show = [sys.executable, "-m", "router", "session", "show", "my-chat", "--json"]
    show += ["--api-key", env["OPENAI_API_KEY"], "--redis-url", env["REDIS_URL"]]
    state = json.loads(subprocess.run(show, capture_output=True, text=True, check=True).stdout)
    assert state["state"]["turn"] == 2, "curl's turn and the SDK's, in one session"
    line = re.search(r"^  (\S+ session show demo-\w+ .+)$", output, re.MULTILINE)
    assert line is not None, output
    shown = subprocess.run(["bash", "-c", line[1]], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and re.search(r"^  turn\s+4$", shown.stdout, re.M), shown
