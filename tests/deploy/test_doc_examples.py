"""The README's and docs' command blocks aimed at the demo run as written against `kvbaton
demo` (issue 51). A block is marked by an HTML comment on the line before its fence:

    <!-- demo-tested [continues] [expect=REGEX] -->

python blocks run with this venv's python, bash blocks with `bash -e -o pipefail`, in the
environment the demo's printed `export` line gives (and this venv's bin first on PATH, where
`kvbaton` is); `continues` runs the file's previous marked python block first (its `client`,
its `model`); `expect` must match the block's output (re.MULTILINE). Real processes: the demo
(redis-server, simulator P and D, the router), curl, redis-cli, the OpenAI SDK."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.procs import free_port, output_until
from tests.conftest import PULL_FIRST_ENV

ROOT = Path(__file__).resolve().parents[2]
FILES = ("README.md", "docs/operations.md")
MARKED = re.compile(
    r"^<!-- demo-tested(?P<continues> continues)?(?: expect=(?P<expect>\S+))? -->\n"
    r"```(?P<lang>\w+)\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


@dataclass(frozen=True)
class Block:
    where: str  # file:line
    lang: str
    code: str  # with the blocks it continues, first
    expect: str | None


def blocks(name: str) -> list[Block]:
    text = (ROOT / name).read_text()
    found: list[Block] = []
    previous_python = ""
    for match in MARKED.finditer(text):
        code = match["code"]
        if match["continues"]:
            assert previous_python, f"{name}: a block continues no python block before it"
            code = previous_python + code
        if match["lang"] == "python":
            previous_python = code
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(f"{name}:{line}", match["lang"], code, match["expect"]))
    return found


def test_the_examples_aimed_at_the_demo_are_marked() -> None:
    """The blocks named in the issue stay marked (a marker dropped is a block untested)."""
    readme = blocks("README.md")
    assert [b.lang for b in readme] == ["python"] * 3 + ["bash"] * 3, readme
    assert any("redis-cli -u" in b.code for b in readme)
    assert any("kvbaton session show" in b.code for b in readme)
    assert [b.lang for b in blocks("docs/operations.md")] == ["bash"]
    for name in FILES:
        assert all("Qwen" not in b.code for b in blocks(name)), "the demo serves sim-model"


@pytest.fixture(scope="module")
def demo_env() -> Iterator[dict[str, str]]:
    """A serving demo, and the environment its export line gives. The demo runs as shipped
    (not with the tests' PULL_FIRST_ENV): the examples show what a reader gets."""
    port = free_port()
    shipped = {k: v for k, v in os.environ.items() if k not in PULL_FIRST_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "demo", "--port", str(port)],
        cwd=ROOT,
        env=shipped,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = output_until(proc, "Serving.")
        exports = re.search(r"^  export (.+)$", seen, re.MULTILINE)
        assert exports is not None, seen
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "KVBATON_"))}
        env.update(pair.split("=", 1) for pair in exports[1].split())
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        yield env
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.timeout(180)
def test_the_marked_blocks_run_against_the_demo(demo_env: dict[str, str]) -> None:
    """In document order, README first: its examples make `chat-42`, which the next ones
    look up, and docs/operations.md's recipes end by deleting it."""
    ran = 0
    for name in FILES:
        for block in blocks(name):
            if block.lang == "python":
                argv = [sys.executable, "-c", block.code]
            else:
                argv = ["bash", "-e", "-o", "pipefail", "-c", block.code]
            done = subprocess.run(
                argv, cwd=ROOT, env=demo_env, capture_output=True, text=True, timeout=60
            )
            out = done.stdout + done.stderr
            assert done.returncode == 0, f"{block.where} failed:\n{block.code}\n---\n{out}"
            if block.expect:
                assert re.search(block.expect, done.stdout, re.MULTILINE), (
                    f"{block.where}: no {block.expect!r} in its output:\n{done.stdout}"
                )
            ran += 1
    assert ran == 7
