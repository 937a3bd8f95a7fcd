"""Section 8's pure parts: vLLM's multi-turn benchmark output read back as turns, its offline
tokenizer and text, and the README's headline table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import headline, peers, vllm_multiturn
from vllm_sim import hf_tokenizer
from vllm_sim.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


def stat(conv: str, messages: int, ttft_ms: float, start_ms: float) -> dict[str, Any]:
    return {
        "conversation_id": conv,
        "input_num_turns": messages,
        "ttft_ms": ttft_ms,
        "start_time_ms": start_ms,
        "latency_ms": 100.0,
    }


# One conversation of two turns, as the benchmark writes it back when it ends.
CONV_A: dict[str, Any] = {
    "id": "A",
    "messages": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ],
}


def test_benchmark_output_as_turns() -> None:
    stats = [stat("A", 1, 30.0, 1000.0), stat("A", 3, 20.0, 1200.0), stat("B", 1, 40.0, 1100.0)]
    convs = [CONV_A]  # B did not end: not written back
    log = "Client 0 is done (num_successes=2, num_failures=0)\n"
    log += "Client 1 is done (num_successes=1, num_failures=2)\n"
    out = vllm_multiturn.parse(stats, convs, log)
    ok = [t for t in out["turns"] if t["ok"]]
    assert [(t["conv"], t["turn"], t["ttft"], t["answer"]) for t in ok] == [
        ("A", 1, 0.03, "a1"),
        ("A", 2, 0.02, "a2"),
        ("B", 1, 0.04, None),
    ]
    assert sum(not t["ok"] for t in out["turns"]) == 2
    assert out["seconds"] == pytest.approx(0.3)  # 1000 ms to 1200 + 100 ms
    assert out["unmeasured"] == 0 and out["unmeasured_answers"] == []
    assert vllm_multiturn.parse([], [], "")["turns"] == []


def test_an_answered_turn_the_benchmark_did_not_measure_is_still_compared() -> None:
    """Its stats can miss a request a client answered just before its end (seen under load):
    that turn has no TTFT, but its answer, written back with the conversation, is compared
    with kvbaton's like any other."""
    convs = [CONV_A]
    full = vllm_multiturn.parse([stat("A", 1, 30.0, 0.0), stat("A", 3, 20.0, 100.0)], convs, "")
    short = vllm_multiturn.parse([stat("A", 1, 30.0, 0.0)], convs, "")
    assert short["unmeasured"] == 1 and short["unmeasured_answers"] == [["A", 2, "a2"]]
    edited = {**short, "unmeasured_answers": [["A", 2, "other"]]}
    arms: dict[str, Any] = {
        name: {"rounds": [rnd], "summary": {}}
        for name, rnd in (("kvbaton", full), ("short", short), ("edited", edited))
    }
    peers.answers_compared(arms)
    assert arms["short"]["summary"] == {"compared": 2, "differ": 0}
    assert arms["edited"]["summary"] == {"compared": 2, "differ": 1}


def test_tokenizer_folder_and_text_split_as_the_simulators(tmp_path: Path) -> None:
    hf_tokenizer.write(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    text = vllm_multiturn.words_text(500)
    ids = Tokenizer().encode(text)
    assert all(tid in vocab.values() for tid in ids)  # every piece of the text is a word here
    assert len(ids) >= 500 and text.endswith(".\n")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["unk_token"] in vocab


def summary(p50: float, p90: float, failed: int = 0) -> dict[str, Any]:
    return {
        "summary": {
            "ttft_later": {"p50": p50, "p90": p90},
            "turns": 100,
            "failed": failed,
            "cpu_ms_per_turn": 2.0,
        }
    }


def test_headline_says_where_kvbaton_is_not_ahead(tmp_path: Path) -> None:
    peers = {
        "scenarios": {
            "short": {"arms": {"kvbaton": summary(16, 19), "other": summary(12, 14)}},
            "long": {"arms": {"kvbaton": summary(19, 25), "other": summary(33, 39)}},
            "D fails": {"arms": {"kvbaton": summary(15, 18, 4), "other": summary(12, 13, 43)}},
        }
    }
    block = headline.lines(peers, "a run")
    text = "\n".join(block)
    assert "| kvbaton | 16 / 19 | 19 / 25 | 15 / 18 (4 of 100 failed) |" in text
    assert "- short: **other** is lowest, 12.0 / 14.0 ms against kvbaton's 16.0 / 19.0." in text
    assert "- long: kvbaton is lowest, 19.0 / 25.0 ms." in text
    assert "| other | 12 / 14 | 33 / 39 | 12 / 13 (43 of 100 failed) |" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{headline.START}\nold\n{headline.END}\n\nrest\n")
    assert headline.update(readme, block)
    assert readme.read_text() == f"# x\n\n{text}\n\nrest\n"
    readme.write_text("no markers\n")
    assert not headline.update(readme, block)


def arm(cpu: float) -> dict[str, Any]:
    """A scenario's arm as far as router CPU per turn goes."""
    return {"summary": {"cpu_ms_per_turn": cpu}}


def test_the_target_row_compares_kvbaton_with_vllm_router() -> None:
    from bench import targets

    arms = {"kvbaton": arm(15.0), "vllm-router cache_aware": arm(6.0)}
    res = {"scenarios": {peers.MULTITURN.name: {"arms": arms}}}
    ((target, reference, measured, met),) = targets.peer_rows(res)
    assert "<= 1.5x vllm-router's" in target and "*Side by side*" in reference
    assert (measured, met) == ("2.50x (15.00 vs 6.00 ms)", False)
    arms["kvbaton"] = arm(8.4)
    ((_, _, measured, met),) = targets.peer_rows(res)
    assert (measured, met) == ("1.40x (8.40 vs 6.00 ms)", True)
    assert targets.peer_rows(None) == [] and targets.peer_rows({"scenarios": {}}) == []


def test_the_saved_results_keep_the_summaries_not_the_turns() -> None:
    turn = {"conv": 0, "turn": 2, "ok": True, "ttft": 0.01, "answer": "x"}
    rnd = {"turns": [turn], "unmeasured_answers": [[0, 3, "y"]], "cpu_s": 1.0}
    arm = {"how": "h", "rounds": [rnd], "summary": {"turns": 1}}
    out = peers.without_turns({"scenarios": {"arrivals": {"arms": {"kvbaton": arm}}}})
    kept = out["scenarios"]["arrivals"]["arms"]["kvbaton"]
    assert kept == {"how": "h", "rounds": [{"cpu_s": 1.0}], "summary": {"turns": 1}}
