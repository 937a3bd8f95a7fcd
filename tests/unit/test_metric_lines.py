"""Reading an engine's /metrics text by the lines that start with a metric's name reads what
the MULTILINE regexes over the whole text read (they are the reference here), on the shapes
vLLM writes and on shuffled, cut and damaged texts."""

from __future__ import annotations

import random
import re

import pytest

from router.engines import ranks
from router.engines.metrics_text import (
    engine_requests,
    kv_discarded,
    kv_usage,
    matches,
    metric_lines,
    process_started,
)
from router.lifecycle import discovery

_M = re.MULTILINE
REF_STARTED = re.compile(rb"^process_start_time_seconds (\S+)$", _M)
REF_REQUESTS = re.compile(rb"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)$", _M)
REF_KV = re.compile(rb"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", _M)
REF_SLEEP = re.compile(
    rb'^vllm:engine_sleep_state\{[^}]*sleep_state="(weights_offloaded|discard_all)"[^}]*\} (\S+)$',
    _M,
)
REF_RUNNING = re.compile(rb'^vllm:num_requests_running\{[^}]*\bengine="(\d+)"', _M)
REF_BLOCK = re.compile(rb'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', _M)

LINES = [
    b"# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
    b"# TYPE process_start_time_seconds gauge",
    b"process_start_time_seconds 1.79601578555e+09",
    b"process_start_time_seconds soon",
    b'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
    b'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
    b'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
    b'vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 9.0',
    b"vllm:num_requests_running 1.0",
    b'vllm:num_requests_running{engine="2"} x',
    b"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
    b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
    b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
    b"vllm:kv_cache_usage_perc 0.5",
    b'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0',
    b'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 1.0',
    b'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0',
    b'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0"} 1.0',
    b'vllm:prompt_tokens_total{engine="0",model_name="m"} 12.0',
    b"",
    b"  process_start_time_seconds 5",
]


def _ref(text: bytes) -> tuple[object, ...]:
    def samples(pattern: re.Pattern[bytes]) -> list[float]:
        out = []
        for m in pattern.finditer(text):
            try:
                out.append(float(m.group(m.lastindex or 1)))
            except ValueError:
                continue
        return out

    started = REF_STARTED.search(text)
    try:
        first = float(started.group(1)) if started else 0.0
    except ValueError:
        first = 0.0
    sleeping = [v for v in samples(REF_SLEEP) if v >= 1.0]
    block = REF_BLOCK.search(text)
    return (
        first,
        int(sum(samples(REF_REQUESTS))),
        max(samples(REF_KV), default=None),
        bool(sleeping),
        len(set(REF_RUNNING.findall(text))),
        int(block.group(1)) if block else 0,
    )


def _ours(text: bytes) -> tuple[object, ...]:
    block = next(matches(discovery._BLOCK_SIZE, text, whole=False), None)
    return (
        process_started(text),
        engine_requests(text),
        kv_usage(text),
        kv_discarded(text),
        ranks.learned_size(text),
        int(block.group(1)) if block else 0,
    )


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_a_whole_text_reads_as_the_regexes_read_it(eol: bytes) -> None:
    text = eol.join(LINES) + eol
    assert _ours(text) == _ref(text)
    assert _ours(text)[:4] == (
        (1.79601578555e09, 10, 0.75, True) if eol == b"\n" else (0.0, 0, None, False)
    )


def test_shuffled_cut_and_damaged_texts_read_as_the_regexes_read_them() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        lines = rng.sample(LINES, rng.randrange(0, len(LINES) + 1))
        text = b"\n".join(lines)
        if rng.random() < 0.5:
            text += b"\n"
        if text and rng.random() < 0.3:  # cut anywhere, or a byte changed
            cut = rng.randrange(len(text))
            text = text[:cut] if rng.random() < 0.5 else text[:cut] + b"}" + text[cut + 1 :]
        assert _ours(text) == _ref(text), text


def test_metric_lines_are_whole_lines_that_start_with_the_prefix() -> None:
    text = b"ab 1\nxab 2\nab 3\r\n\nab"
    assert list(metric_lines(text, b"ab")) == [b"ab 1", b"ab 3\r", b"ab"]
    assert list(metric_lines(b"", b"ab")) == []
    assert list(metric_lines(b"x\n", b"ab")) == []
