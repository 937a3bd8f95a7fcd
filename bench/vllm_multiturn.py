"""vLLM's multi-turn benchmark, unchanged, as a scenario of section 8: copied at run time out of
a fetched vLLM tree into a scratch folder (never into the project) and run offline."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import peer_venv
from harness.procs import log_file
from vllm_sim import hf_tokenizer
from vllm_sim.words import COMMON

DIR = "benchmarks/multi_turn"
SCRIPT = "benchmark_serving_multi_turn.py"
FILES = tuple(f"{DIR}/{name}" for name in (SCRIPT, "bench_dataset.py", "bench_utils.py"))
CONFIG = f"{DIR}/generate_multi_turn.json"  # its example config of synthetic conversations
REQUIREMENTS = f"{DIR}/requirements.txt"
MODEL = "sim-model"  # what the simulators serve
TEXT_WORDS = 120_000  # its config draws ~30k tokens of text; room to spare
# The smaller config of --quick (3 user turns in each of 4 conversations, short answers).
QUICK_CONFIG: dict[str, Any] = {
    "num_conversations": 4,
    "num_turns": {"distribution": "constant", "value": 6},
    "common_prefix_num_tokens": {"distribution": "constant", "value": 100},
    "prefix_num_tokens": {"distribution": "constant", "value": 200},
    "num_tokens": {"distribution": "uniform", "min": 40, "max": 60},
    "output": {"distribution": "uniform", "min": 20, "max": 30},
}
# Clients, each with one active conversation at a time (its default): a client that holds more
# drops those still active when the conversations run out, and which ones depends on timing,
# so the arms would not get the same requests.
FULL_CLIENTS, QUICK_CLIENTS = 6, 2
# The benchmark sends its conversation id in the body only (this copy has no option for a
# header); vllm-router's session policies hash an X-Session-ID header. This module, on the
# benchmark's path as `sitecustomize`, copies the id into that header for every arm.
SESSION_HEADER_HOOK = '''"""kvbaton's bench: the body's conversation_id also as X-Session-ID."""
import aiohttp

_request = aiohttp.ClientSession._request


async def _with_session_header(self, method, url, **kwargs):
    body = kwargs.get("json")
    if isinstance(body, dict) and "conversation_id" in body:
        session = {"X-Session-ID": str(body["conversation_id"])}
        kwargs["headers"] = {**(kwargs.get("headers") or {}), **session}
    return await _request(self, method, url, **kwargs)


aiohttp.ClientSession._request = _with_session_header
'''


@dataclass(frozen=True)
class Bench:
    """The benchmark ready to run from its scratch folder."""

    scratch: Path
    python: str  # .venv-peers' interpreter, with the benchmark's requirements
    config: dict[str, Any]  # the synthetic-conversation config it reads
    clients: int
    timeout_s: float


def prepare(quick: bool) -> Bench | None:
    """The benchmark's files copied out of the vLLM tree, its requirements installed into
    .venv-peers, a tokenizer and a text file written beside it; None (and one line saying
    why) without a tree."""
    scratch = peer_venv.vllm_copy(FILES, (), "vLLM's multi-turn benchmark")
    if scratch is None:
        return None
    try:
        lines = peer_venv.tree_file(REQUIREMENTS).decode().splitlines()
        requirements = [r for r in (line.split("#")[0].strip() for line in lines) if r]
        stamp = peer_venv.PEERS_VENV / ".multiturn-requirements"  # pip's own check takes seconds
        if not stamp.exists() or stamp.read_text() != "\n".join(requirements):
            pip = [str(peer_venv.PEERS_VENV / "bin" / "pip"), "install", "-q", *requirements]
            subprocess.run(pip, check=True, capture_output=True, timeout=900)
            stamp.write_text("\n".join(requirements))
        config = json.loads(peer_venv.tree_file(CONFIG))
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        print(f"peers: vLLM's multi-turn benchmark skipped: {exc}", file=sys.stderr)
        return None
    hf_tokenizer.write(scratch / "tokenizer")
    text = scratch / "words.txt"
    text.write_text(words_text(TEXT_WORDS))
    config["text_files"] = [str(text)]
    if quick:
        config = quick_config(config)
    hook = scratch / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SESSION_HEADER_HOOK)
    clients = QUICK_CLIENTS if quick else FULL_CLIENTS
    python = str(peer_venv.PEERS_VENV / "bin" / "python")
    return Bench(scratch, python, config, clients, 120.0 if quick else 900.0)


def quick_config(config: dict[str, Any]) -> dict[str, Any]:
    small: dict[str, Any] = json.loads(json.dumps(config))
    small["num_conversations"] = QUICK_CONFIG["num_conversations"]
    for key in ("num_turns", "common_prefix_num_tokens", "prefix_num_tokens", "num_tokens"):
        small["prompt_input"][key] = QUICK_CONFIG[key]
    small["prompt_output"]["num_tokens"] = QUICK_CONFIG["output"]
    return small


def words_text(n: int) -> str:
    """n of the simulators' vocabulary words in sentences (seeded): one token each, and one
    more per full stop, in both tokenizers."""
    rng = random.Random(33)
    sentences: list[str] = []
    left = n
    while left > 0:
        k = min(left, rng.randint(6, 18))
        words = [rng.choice(COMMON) for _ in range(k)]
        sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
        left -= k
    return " ".join(sentences) + "\n"


def run(bench: Bench, url: str, name: str) -> dict[str, Any]:
    """The benchmark against url until every conversation has ended (`--no-early-stop`, so
    every arm sends the same requests): its requests as turns, and its time."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=bench.scratch))
    config = out / "config.json"
    config.write_text(json.dumps(bench.config))
    argv = [bench.python, str(bench.scratch / SCRIPT), "--url", url]
    argv += ["--model", str(bench.scratch / "tokenizer"), "--served-model-name", MODEL]
    argv += ["--input-file", str(config), "--seed", "0", "--no-early-stop"]
    argv += ["--num-clients", str(bench.clients), "--max-active-conversations", str(bench.clients)]
    argv += ["--stats-json-output", str(out / "stats.json")]
    argv += ["--output-file", str(out / "convs.json")]
    env = dict(os.environ, PYTHONPATH=str(bench.scratch / "hook"), HF_HUB_OFFLINE="1")
    env.update(TRANSFORMERS_OFFLINE="1")
    log = log_file("vllm-multiturn")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        fh.write(f"# {name}: {' '.join(argv)}\n".encode())
        fh.flush()
        try:
            code: int | str = subprocess.call(
                argv,
                cwd=bench.scratch,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=bench.timeout_s,
            )
        except subprocess.TimeoutExpired:
            code = f"no end within {bench.timeout_s:.0f} s"
    text = log.read_text(errors="replace")
    if code != 0 or not (out / "stats.json").exists():
        return {"turns": [], "seconds": 0.0, "error": f"exit {code}: {text[-300:]}"}
    return parse(
        json.loads((out / "stats.json").read_text()),
        json.loads((out / "convs.json").read_text()) if (out / "convs.json").exists() else [],
        text,
    )


def parse(stats: list[dict[str, Any]], convs: list[dict[str, Any]], log: str) -> dict[str, Any]:
    """Its per-request stats as turns (TTFT in seconds, the turn from the messages sent),
    each with its answer where the conversation ended (the output file holds only those),
    one failed turn per failure it logged, and the time from the first request to the end
    of the last."""
    answers = {
        (c["id"], i // 2 + 1): m["content"]
        for c in convs
        for i, m in enumerate(c["messages"])
        if m["role"] == "assistant"
    }
    turns: list[dict[str, Any]] = []
    for r in stats:
        turn = (int(r["input_num_turns"]) + 1) // 2
        conv = str(r["conversation_id"])
        turns.append(
            {
                "conv": conv,
                "turn": turn,
                "ttft": float(r["ttft_ms"]) / 1000,
                "ok": True,
                "answer": answers.get((conv, turn)),
                "reuse": "",
            }
        )
    failed = sum(int(n) for n in re.findall(r"num_failures=(\d+)", log))
    turns += [{"conv": "", "turn": 0, "ttft": 0.0, "ok": False, "reuse": ""}] * failed
    ends = [float(r["start_time_ms"]) + float(r["latency_ms"]) for r in stats]
    starts = [float(r["start_time_ms"]) for r in stats]
    seconds = (max(ends) - min(starts)) / 1000 if stats else 0.0
    # Answered, but without a measurement: the benchmark drains its clients' result queue
    # with Queue.empty(), which can miss one put just before a client's end (seen under load).
    # Their answers are still compared across arms ([conversation, turn, answer] each).
    measured = {(t["conv"], t["turn"]) for t in turns}
    unmeasured = [[c, n, a] for (c, n), a in answers.items() if (c, n) not in measured]
    return {
        "turns": turns,
        "seconds": seconds,
        "unmeasured": len(unmeasured),
        "unmeasured_answers": unmeasured,
    }
