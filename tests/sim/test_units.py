"""Pure parts as tables: tokenizer, template, KV chain, block pool, output text, transfer rules."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sim import model, transfer
from vllm_sim.api import parse
from vllm_sim.blocks import BlockPool, Cleared, NoFreeBlocks, Removed, Stored
from vllm_sim.clock import SimClock
from vllm_sim.config import parse_settings
from vllm_sim.errors import ApiError
from vllm_sim.faults import Faults
from vllm_sim.metrics import READ_WAIT_BUCKETS, Histogram
from vllm_sim.output import OutputText
from vllm_sim.template import TemplateError, render
from vllm_sim.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS, Tokenizer

TOK = Tokenizer()


# -- tokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("", 0),
        ("the", 1),
        (" the", 1),
        ("the end", 2),
        ("The End", 2),
        ("42", 2),
        ("a, b!", 5),  # " b" is not a word: two byte tokens
        ("\n\n", 2),
        ("héllo", len("héllo".encode())),  # not in the vocabulary: one token per byte
        ("<|user|>", 1),
        ("<|nope|>", 8),
    ],
)
def test_encode_counts(text: str, count: int) -> None:
    assert len(TOK.encode(text)) == count
    assert TOK.decode(TOK.encode(text)) == text


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_any_text_round_trips(text: str) -> None:
    assert TOK.decode(TOK.encode(text)) == text.encode("utf-8", "surrogatepass").decode(
        "utf-8", "replace"
    )


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(TOK.emittable), min_size=1, max_size=50))
def test_generated_text_retokenizes_to_the_same_ids(ids: list[int]) -> None:
    assert TOK.encode(TOK.decode(ids)) == ids


def test_special_tokens() -> None:
    assert TOK.encode(SPECIAL_TOKENS[0]) == [BOS_ID]
    assert TOK.encode(SPECIAL_TOKENS[1]) == [EOS_ID]
    assert TOK.decode([BOS_ID, *TOK.encode(" the")], skip_special_tokens=True) == " the"
    assert all(not TOK.is_special(t) for t in TOK.emittable)


# -- template -------------------------------------------------------------------------------


def test_template_layout() -> None:
    nl = TOK.encode("\n")
    user, assistant, system = (TOK.token_id(f"<|{r}|>") for r in ("user", "assistant", "system"))
    ids = render(TOK, [{"role": "system", "content": "be"}, {"role": "user", "content": "the"}])
    assert ids == [BOS_ID, system, *TOK.encode("be"), *nl, user, *TOK.encode("the"), *nl, assistant]
    no_gen = render(TOK, [{"role": "user", "content": "the"}], add_generation_prompt=False)
    assert no_gen == ids[: len(no_gen)] or no_gen[-1] == nl[-1]


def test_template_content_parts_reasoning_and_unknown_roles() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render(TOK, [{"role": "user", "content": parts}]) == render(
        TOK, [{"role": "user", "content": "a\nb"}]
    )
    with_reasoning = {"role": "assistant", "content": " x", "reasoning_content": "thinking"}
    assert render(TOK, [with_reasoning]) == render(TOK, [{"role": "assistant", "content": " x"}])
    assert render(TOK, [{"role": "critic", "content": None}])[1:] == [
        *TOK.encode("<|critic|>"),
        *TOK.encode("\n"),
        TOK.token_id("<|assistant|>"),
    ]
    for bad in (
        {"content": "x"},
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "user", "content": 3},
    ):
        with pytest.raises(TemplateError):
            render(TOK, [bad])


def test_template_turns_extend() -> None:
    turn1 = [{"role": "user", "content": "the end"}]
    out = TOK.emittable[:5]
    turn2 = [*turn1, {"role": "assistant", "content": TOK.decode(out)}]
    ids1, ids2 = render(TOK, turn1), render(TOK, turn2)
    assert ids2[: len(ids1) + len(out)] == ids1 + out


# -- KV chain and hashes --------------------------------------------------------------------


def test_kv_chain_carries_history() -> None:
    a = model.kv_chain(model.KV_ROOT, [1, 2, 3])
    b = model.kv_chain(model.KV_ROOT, [9, 2, 3])
    assert a[1:] != b[1:]  # same tokens at 1..2, different history
    assert model.kv_chain(a[0], [2, 3]) == a[1:]
    assert all(0 <= v < 2**64 for v in a)
    assert model.sample(a[-1], TOK.emittable) == model.sample(a[-1], TOK.emittable)


def test_block_hashes_chain_and_full_blocks_only() -> None:
    ids = list(range(40))
    hashes = model.block_hashes(ids, 16)
    assert len(hashes) == 2
    assert hashes[1] == model.block_hash(hashes[0], ids[16:32])
    assert model.block_hashes([0, *ids[1:]], 16) == hashes
    assert model.block_hashes([7, *ids[1:]], 16)[1] != hashes[1]  # parent changed
    assert all(0 <= h < 2**64 for h in hashes)


# -- block pool -----------------------------------------------------------------------------


def test_pool_prefix_hits_and_lru_eviction() -> None:
    pool = BlockPool(num_blocks=5, block_size=2)  # 4 usable
    assert pool.num_free == 4
    a = pool.allocate(2)
    pool.cache_full_blocks(a, [11, 12], None, [1, 2, 3, 4])
    assert pool.drain_events() == [Stored([11, 12], None, [1, 2, 3, 4])]
    assert pool.match_prefix([11, 12, 13]) == a
    assert pool.match_prefix([13, 11]) == []
    pool.free(a)  # tail block queued first: evicted first
    assert pool.num_free == 4 and pool.usage == 0.0
    b = pool.allocate(2)  # the two never-used blocks
    assert set(b).isdisjoint(a)
    c = pool.allocate(1)
    assert c == [a[1]] and pool.drain_events() == [Removed([12])]
    assert pool.match_prefix([11, 12]) == [a[0]]
    pool.touch([a[0]])  # a hit takes it out of the free queue
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_pool_duplicate_hashes_and_reset() -> None:
    pool = BlockPool(num_blocks=6, block_size=1)
    x, y = pool.allocate(2), pool.allocate(2)
    pool.cache_full_blocks(x, [1, 2], None, [5, 6])
    pool.cache_full_blocks(y, [1, 3], None, [5, 7])  # hash 1 already cached by x
    assert pool.drain_events() == [Stored([1, 2], None, [5, 6]), Stored([3], 1, [7])]
    assert pool.free_needed(x, 1) == 1
    pool.free(x)
    assert pool.free_needed(x, 1) == 3
    pool.reset_prefix_cache()
    assert pool.num_cached == 0 and pool.drain_events() == [Cleared()]
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, block_size=1)


def test_pool_contents_survive_free() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    ids = pool.allocate(2)
    pool.write(ids, 0, [10, 11, 12])
    assert pool.kv_at(ids, 2) == 12
    pool.free(ids)
    assert pool.read(ids) == [[10, 11], [12, 0]]  # stale but readable, as RDMA would be


# -- output text ----------------------------------------------------------------------------


def _run(out: OutputText, ids: list[int]) -> tuple[str, str | None]:
    text, stop = "", None
    for t in ids:
        d = out.add(t)
        text += d.content
        if d.stop_reason:
            return text, d.stop_reason
    return text + out.flush(), stop


@pytest.mark.parametrize(
    ("stop", "include", "min_tokens", "expected"),
    [
        ((), False, 0, (" the end of it", None)),
        ((" end",), False, 0, (" the", " end")),
        ((" end",), True, 0, (" the end", " end")),
        (("e e",), False, 0, (" th", "e e")),  # spans two tokens
        ((" end",), False, 3, (" the end of it", None)),
        ((" of", " end"), False, 0, (" the", " end")),
    ],
)
def test_stop_strings(
    stop: tuple[str, ...], include: bool, min_tokens: int, expected: tuple[str, str | None]
) -> None:
    ids = TOK.encode(" the end of it")
    assert _run(OutputText(TOK, stop, include, min_tokens), ids) == expected


def test_reasoning_split() -> None:
    out = OutputText(TOK, reasoning_tokens=2)
    deltas = [out.add(t) for t in TOK.encode(" the end of it")]
    assert [d.reasoning for d in deltas] == [" the", " end", "", ""]
    assert "".join(d.content for d in deltas) + out.flush() == " of it"


# -- NixlConnector rules --------------------------------------------------------------------

SRC: dict[str, Any] = {
    "remote_engine_id": "e",
    "remote_request_id": "r",
    "remote_host": "h",
    "remote_port": 1,
    "remote_block_ids": [[5, 6, 7]],
}


@pytest.mark.parametrize(
    ("params", "bidir", "kind", "producer"),
    [
        (None, False, "none", False),
        ({}, True, "none", False),
        ({"do_remote_decode": True}, True, "plain", True),
        ({"do_remote_prefill": True, **SRC}, False, "pull_prompt", False),
        ({"do_remote_prefill": True, **SRC, "remote_request_id": None}, False, "plain", False),
        ({"do_remote_decode": True, **SRC}, True, "pull_bidir", True),
        ({"do_remote_decode": True, **SRC}, False, "plain", True),
        ({"do_remote_decode": True, **SRC, "remote_block_ids": [5, 6]}, True, "pull_bidir", True),
        ({"do_remote_decode": True, **SRC, "remote_block_ids": [["x"]]}, True, "plain", True),
    ],
)
def test_classify(params: Any, bidir: bool, kind: str, producer: bool) -> None:
    leg = transfer.classify(params, bidir)
    assert (leg.kind, leg.is_producer) == (kind, producer)


@pytest.mark.parametrize(
    ("kind", "remote_tokens", "prompt", "hit", "threshold", "count"),
    [
        ("pull_prompt", None, 40, 16, 0, 24),
        ("pull_bidir", 100, 150, 32, 64, 68),
        ("pull_bidir", 100, 150, 48, 64, 0),  # 52 < threshold: recompute
        ("pull_bidir", 100, 80, 0, 0, 80),  # prompt shorter than D's sequence
        ("pull_bidir", 30, 80, 32, 0, 0),  # P already holds more
        ("pull_bidir", 0, 1, 0, 0, 0),  # the router's release: read nothing, notify D
        ("pull_bidir", None, 80, 0, 0, 0),  # vLLM reads `remote_num_tokens or 0`
        ("plain", 100, 150, 0, 0, 0),
    ],
)
def test_tokens_to_pull(
    kind: str, remote_tokens: int | None, prompt: int, hit: int, threshold: int, count: int
) -> None:
    params = {"do_remote_decode": kind != "pull_prompt", "do_remote_prefill": kind == "pull_prompt"}
    params |= {**SRC, "remote_num_tokens": remote_tokens} if kind != "plain" else {}
    leg = transfer.classify(params, bidirectional=True)
    assert transfer.tokens_to_pull(leg, prompt, hit, threshold) == count


def test_explicit_threshold_gates_prompt_pulls() -> None:
    leg = transfer.classify({"do_remote_prefill": True, **SRC}, bidirectional=False)
    assert transfer.tokens_to_pull(leg, 40, 0, 64) == 40
    assert transfer.tokens_to_pull(leg, 40, 0, 64, gate_prompt_pulls=True) == 0
    assert transfer.tokens_to_pull(leg, 80, 0, 64, gate_prompt_pulls=True) == 80
    assert not parse_settings(["--bidirectional"]).threshold_gates_prefill_pulls
    assert parse_settings(["--kv-recompute-threshold", "8"]).threshold_gates_prefill_pulls


def test_remote_blocks_suffix_trim() -> None:
    ids = [10, 11, 12, 13]
    assert transfer.remote_blocks(ids, 0, 64, 16) == ids
    assert transfer.remote_blocks(ids, 32, 32, 16) == [12, 13]
    assert transfer.remote_blocks(ids, 32, 20, 16) == [12, 13]
    assert transfer.remote_blocks(ids, 0, 20, 16) == [12, 13]  # the vllm#43094 offset
    with pytest.raises(ValueError):
        transfer.remote_blocks(ids, 0, 80, 16)


def test_expiry_margin() -> None:
    assert not transfer.is_expired(None, 1e9)
    assert transfer.is_expired(100.0, 95.0)
    assert not transfer.is_expired(100.0, 94.9)


# -- request parsing and faults -------------------------------------------------------------


def test_parse_defaults_and_limits() -> None:
    msgs = {"messages": [{"role": "user", "content": "the"}]}
    kw: dict[str, Any] = {"served_model": "m", "max_model_len": 20, "default_max_tokens": 64}
    p = parse(TOK, msgs, chat=True, **kw)
    assert p.max_tokens == 20 - len(p.prompt) and not p.stream
    p = parse(TOK, {**msgs, "max_completion_tokens": 3, "max_tokens": 9}, chat=True, **kw)
    assert p.max_tokens == 3
    p = parse(TOK, {"prompt": [1, 2], "add_special_tokens": False}, chat=False, **kw)
    assert p.prompt == [1, 2] and p.max_tokens == 16
    for bad in (
        {"prompt": [TOK.vocab_size]},
        {"prompt": [-1]},
        {"prompt": ""},
        {"prompt": [[1], [2]]},
    ):
        with pytest.raises(ApiError):
            parse(TOK, bad, chat=False, **kw)
    with pytest.raises(ApiError):
        parse(TOK, {**msgs, "max_tokens": 0}, chat=True, **kw)
    with pytest.raises(ApiError):
        parse(TOK, {**msgs, "stream": "yes"}, chat=True, **kw)


def test_faults_take_and_validate() -> None:
    f = Faults()
    f.update({"fail_next": 1, "status": 500, "drop_next": 1, "drop_after_chunks": 2})
    assert f.take().fail_status == 500
    inj = f.take()
    assert inj.drop_after_chunks == 2 and inj.fail_status is None
    assert f.take().drop_after_chunks is None
    f.update({"stall_s": 0.5})
    assert f.take().stall_s == 0.5 and f.take().stall_s == 0.0
    for bad in ({"status": 200}, {"fail_next": -1}, {"fail_next": True}, {"boom": 1}):
        with pytest.raises(ApiError):
            Faults().update(bad)
    f.update({"fail_next": 3})
    f.clear()
    assert f.state()["fail_next"] == 0 and f.state()["status"] == 503


# -- settings and clock ---------------------------------------------------------------------


def test_settings_defaults_and_derived_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    s = parse_settings([])
    assert (s.role, s.port, s.block_size, s.num_blocks, s.max_model_len) == (
        "prefill",
        8000,
        16,
        4096,
        8192,
    )
    assert s.kv_recompute_threshold == 0 and s.kv_load_failure_policy == "fail"
    assert s.api_key is None and len(s.engine_id) == 36
    s = parse_settings(["--bidirectional", "--host", "0.0.0.0", "--engine-id", "e1"])
    assert s.kv_recompute_threshold == 64 and s.side_channel_host == "127.0.0.1"
    assert s.engine_id == "e1"
    assert (
        parse_settings(["--bidirectional", "--kv-recompute-threshold", "0"]).kv_recompute_threshold
        == 0
    )
    monkeypatch.setenv("VLLM_API_KEY", "k")
    assert parse_settings([]).api_key == "k"
    with pytest.raises(SystemExit):
        parse_settings(["--num-blocks", "8"])
    with pytest.raises(SystemExit):
        parse_settings(["--role", "router"])


def test_clock_and_error_types() -> None:
    t = [5.0]
    clock = SimClock(lambda: t[0])
    clock.advance(2.5)
    assert clock() == 7.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert ApiError("x", status=401).err_type == "Unauthorized"
    assert ApiError("x", status=503).body()["error"]["type"] == "InternalServerError"


def test_read_wait_histogram_renders_cumulative_buckets_and_sums_ranks() -> None:
    """vllm_sim:kv_read_wait_seconds as Prometheus reads it, and a DP engine's ranks as one."""
    a, b = Histogram(READ_WAIT_BUCKETS), Histogram(READ_WAIT_BUCKETS)
    for value in (0.0005, 0.003, 2.0):
        a.observe(value)
    b.observe(0.003)
    both = a + b
    lines = dict(line.rsplit(" ", 1) for line in both.lines("w", 'e="0"'))
    assert lines['w_bucket{e="0",le="0.001"}'] == "1.0"
    assert lines['w_bucket{e="0",le="0.005"}'] == "3.0"  # cumulative
    assert lines['w_bucket{e="0",le="1.0"}'] == "3.0"
    assert lines['w_bucket{e="0",le="+Inf"}'] == lines['w_count{e="0"}'] == "4.0"
    assert float(lines['w_sum{e="0"}']) == pytest.approx(2.0065)
    empty = Histogram(READ_WAIT_BUCKETS) + Histogram(READ_WAIT_BUCKETS)
    assert empty.count == 0 and all(line.endswith(" 0.0") for line in empty.lines("w", "x"))
