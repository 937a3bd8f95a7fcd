"""Store-based P/D end to end: the router (`--kv-connector store`) over 2 P and 2 D simulators
whose KV goes through a shared store (a real redis-server, `--kv-connector store --kv-store`),
through the OpenAI SDK. Every answer is compared with a from-scratch engine's, and the
engines' own counters say where each turn's prompt KV came from."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import redis

from harness.chat import chat_turn, client, get_json, post, reference_answer
from harness.metrics import metric
from harness.procs import SimProc, redis_server, wait_until
from harness.stack import Stack, start_stack
from tests.e2e.conftest import reference_chat
from tests.e2e.helpers import (
    LONG,
    events_flags,
    indexed,
    responses_reference,
    responses_turn,
    spec,
    wait_in_sync,
)

BS = 16  # the simulators' default block size
MAX_TOKENS = 24
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def with_db(url: str, db: int) -> str:
    return urlsplit(url)._replace(path=f"/{db}").geturl()


@dataclass
class StoreStack:
    st: Stack
    kv_url: str  # the engines' KV store (the router's sessions are on db 0)


@contextlib.contextmanager
def store_stack(name: str, d_store_db: int = 1) -> Iterator[StoreStack]:
    with redis_server() as (url, _port, _proc):
        kv = with_db(url, 1)
        p_flags = ("--kv-connector", "store", "--kv-store", kv)
        d_flags = ("--kv-connector", "store", "--kv-store", with_db(url, d_store_db))
        with start_stack(
            prefill=[p_flags] * 2,
            decode=[(*d_flags, "--kv-store-save-decode")] * 2,
            reference=(),  # a plain engine: computes every token
            routers=[
                (
                    "--kv-connector",
                    "store",
                    "--unhealthy-after",
                    "1",
                    "--health-interval",
                    "0.3",
                )
            ],
            redis=url,
            name=name,
        ) as st:
            yield StoreStack(st, kv)


@pytest.fixture(scope="module")
def ss() -> Iterator[StoreStack]:
    with store_stack("store") as s:
        yield s


Counts = dict[str, dict[str, float]]


def counts(engines: list[SimProc]) -> Counts:
    """Each running engine's prompt tokens by source, and its prompt tokens in all, by URL."""
    out: dict[str, dict[str, float]] = {}
    for e in engines:
        if e.proc.poll() is not None:
            continue  # a stopped engine serves nothing
        row = {s: metric(e.url, "vllm:prompt_tokens_by_source_total", source=s) for s in SOURCES}
        row["prompt"] = metric(e.url, "vllm:prompt_tokens_total")
        out[e.url] = row
    return out


def delta(
    after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]
) -> dict[str, Any]:
    return {u: {k: after[u][k] - before[u][k] for k in after[u]} for u in after if u in before}


@dataclass
class Served:
    text: str
    reuse: str
    p: str  # the P that served the turn (the first, if a redo had a second)
    d: str  # and the D
    p_counts: dict[str, float]  # its prompt tokens by source, this turn
    d_counts: dict[str, float]
    p_computed: float  # every P's computed prompt tokens, this turn


class Conversation:
    def __init__(self, s: StoreStack, stream: bool) -> None:
        self.s, self.stream = s, stream
        self.api: openai.OpenAI = client(s.st.router.base_url)
        self.cid = f"store-{uuid.uuid4().hex[:8]}"
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"{self.cid}: a terse assistant about tea."}
        ]
        self.turns = 0
        self.last_prompt = 0  # the previous turn's prompt tokens

    def turn(self) -> Served:
        self.turns += 1
        q = f"Question {self.turns}: is it going to rain on the tea today?"
        self.messages.append({"role": "user", "content": q})
        st = self.s.st
        before = counts(st.engines)
        answer, reuse, _ = chat_turn(
            self.api, self.messages, cid=self.cid, stream=self.stream, max_tokens=MAX_TOKENS
        )
        d = delta(counts(st.engines), before)
        assert answer == reference_chat(st, self.messages, MAX_TOKENS), f"turn {self.turns}"
        self.messages.append({"role": "assistant", "content": answer})
        p = next(u for u in (x.url for x in st.ps) if d.get(u, {}).get("prompt", 0) > 1)
        du = next(u for u in (x.url for x in st.ds) if d.get(u, {}).get("prompt", 0) > 1)
        computed = sum(d[x.url]["local_compute"] for x in st.ps if x.url in d)
        served = Served(answer, reuse, p, du, d[p], d[du], computed)
        served.p_counts["held"] = self.held()
        self.last_prompt = int(d[p]["prompt"])
        return served

    def held(self) -> int:
        """The tokens of the previous turn whose KV D wrote to the store (full blocks of its
        prompt and answer; the last sampled token has no KV)."""
        if not self.last_prompt:
            return 0
        return (self.last_prompt + MAX_TOKENS - 1) // BS * BS


def assert_read_from_store(t: Served, turn: int) -> None:
    """P computed only what is new since the previous turn; the rest it found cached, at least
    the previous answer's blocks in the store (only D had them); D computed under a block."""
    assert t.reuse == "hit;via=store", f"turn {turn}: {t.reuse}"
    held = t.p_counts["held"]
    assert t.p_counts["local_compute"] == t.p_counts["prompt"] - held, f"turn {turn}: {t}"
    assert t.p_counts["external_kv_transfer"] >= BS, f"turn {turn}: nothing from the store: {t}"
    assert t.d_counts["local_compute"] <= BS, f"turn {turn}: D computed {t.d_counts}"


@pytest.mark.parametrize(
    ("stream", "cold"), [(False, False), (True, False), (False, True)], ids=["json", "sse", "cold"]
)
def test_five_turns_read_the_history_from_the_store(
    ss: StoreStack, stream: bool, cold: bool
) -> None:
    """cold: every P's prefix cache is emptied before each turn, so whichever P serves it
    holds nothing of the conversation and reads the whole history from the store."""
    conv = Conversation(ss, stream)
    first = conv.turn()
    assert first.reuse == "miss;reason=no-session"
    assert first.p_counts["external_kv_transfer"] == 0
    for turn in range(2, 6):
        if cold:
            for p in ss.st.ps:
                assert post(p.url + "/reset_prefix_cache", {}).status == 200
        t = conv.turn()
        assert_read_from_store(t, turn)
        if cold:
            assert t.p_counts["local_cache_hit"] == 0, t
            assert t.p_counts["external_kv_transfer"] == t.p_counts["held"], t
    assert metric(ss.st.url, "kvbaton_store_prompt_tokens_total", source="cached") > 0


def instance(router_url: str, role: str, url: str) -> dict[str, Any]:
    status = get_json(router_url + "/status")
    found: dict[str, Any] = next(i for i in status["instances"][role] if i["url"] == url)
    return found


def index_of(group: list[SimProc], url: str) -> int:
    return next(i for i, s in enumerate(group) if s.url == url)


@pytest.mark.timeout(120)
def test_killing_a_prefill_mid_conversation_loses_no_turn(ss: StoreStack) -> None:
    st = ss.st
    conv = Conversation(ss, stream=False)
    conv.turn()
    served = conv.turn()
    victim = index_of(st.ps, served.p)
    st.ps[victim].proc.terminate()
    st.ps[victim].proc.wait(10)
    t3 = conv.turn()  # another P, which never saw this conversation: all from the store
    assert t3.p != served.p
    assert_read_from_store(t3, 3)
    assert t3.p_counts["local_cache_hit"] == 0
    assert t3.p_counts["external_kv_transfer"] == t3.p_counts["held"]
    wait_until(lambda: not instance(st.url, "prefill", served.p)["healthy"], "P not dropped")
    back = st.restart("prefill", victim)
    wait_until(lambda: instance(st.url, "prefill", back.url)["usable"], "P not re-admitted")
    assert_read_from_store(conv.turn(), 4)


@pytest.mark.timeout(120)
def test_killing_a_decode_mid_conversation_loses_no_turn(ss: StoreStack) -> None:
    st = ss.st
    conv = Conversation(ss, stream=True)
    conv.turn()
    d_url = conv.turn().d  # the conversation's D (affinity): kill it
    victim = index_of(st.ds, d_url)
    st.ds[victim].proc.terminate()
    st.ds[victim].proc.wait(10)
    # D fails before its first byte: the turn is redone on the other D with a new P leg on
    # the other P, which finds the whole prompt in the store (the first P leg wrote it).
    t3 = conv.turn()
    assert t3.d != d_url
    assert t3.reuse == "hit;via=store", t3
    assert t3.p_computed <= t3.p_counts["prompt"] - t3.p_counts["held"] + BS, t3
    wait_until(lambda: not instance(st.url, "decode", d_url)["healthy"], "D not dropped")
    back = st.restart("decode", victim)
    wait_until(lambda: instance(st.url, "decode", back.url)["usable"], "D not re-admitted")
    assert_read_from_store(conv.turn(), 4)


def test_a_flushed_store_gives_right_answers_and_an_honest_miss(ss: StoreStack) -> None:
    st = ss.st
    conv = Conversation(ss, stream=False)
    conv.turn()
    assert_read_from_store(conv.turn(), 2)
    redis.Redis.from_url(ss.kv_url).flushdb()
    # The store lost everything; the engines' own caches too (else P finds its own copy).
    for e in st.engines:
        if e.proc.poll() is None:
            assert post(e.url + "/reset_prefix_cache", {}).status == 200
    lost = conv.turn()  # the answer is checked against the reference in turn()
    assert lost.reuse == "miss;reason=store-missed", lost
    assert lost.p_counts["external_kv_transfer"] == 0
    assert lost.p_counts["local_compute"] == lost.p_counts["prompt"]
    assert_read_from_store(conv.turn(), 4)  # D wrote turn 3's blocks again


@pytest.fixture(scope="module")
def events_stack() -> Iterator[StoreStack]:
    """2 P publishing KV events and 1 D, in store mode, and a router subscribed to the Ps."""
    from harness.router import router

    ports = [events_flags(), events_flags()]
    with redis_server() as (url, _port, _proc):
        kv = with_db(url, 1)
        store = ("--kv-connector", "store", "--kv-store", kv)
        with start_stack(
            prefill=[(*store, *ports[0]), (*store, *ports[1])],
            decode=[(*store, "--kv-store-save-decode")],
            reference=(),
            routers=[],
            redis=url,
            name="store-events",
        ) as st:
            args = [
                a
                for p, f in zip(st.ps, ports, strict=True)
                for a in ("--kv-events", spec(p.url, f))
            ]
            with router(
                [p.url for p in st.ps], [st.d.url], "--kv-connector", "store", *args, redis_url=url
            ) as r:
                st.routers.append(r)
                wait_in_sync(st)
                yield StoreStack(st, kv)


def test_a_new_conversation_goes_to_the_p_that_holds_its_prefix(events_stack: StoreStack) -> None:
    """Any P could read the prefix from the store; the one whose own cache holds it (its KV
    events say so) gets the turn, as round robin alone would not do."""
    st = events_stack.st
    api = client(st.router.base_url)
    prefix = [{"role": "system", "content": f"{uuid.uuid4().hex[:6]} {LONG}"}]

    def ask(content: str) -> list[float]:
        before = [metric(p.url, "vllm:prompt_tokens_total") for p in st.ps]
        chat_turn(api, [*prefix, {"role": "user", "content": content}], cid=None, max_tokens=8)
        after = [metric(p.url, "vllm:prompt_tokens_total") for p in st.ps]
        return [a - b for a, b in zip(after, before, strict=True)]

    indexed_before = [indexed(st, p.url) for p in st.ps]
    served = ask("One.")
    holder = 0 if served[0] else 1
    wait_until(lambda: indexed(st, st.ps[holder].url) > indexed_before[holder], "not indexed")
    for n in range(4):
        hits = metric(st.ps[holder].url, "vllm:prefix_cache_hits_total")
        gained = ask(f"Question {n}?")
        assert gained[holder] > 0 and gained[1 - holder] == 0, (n, gained)
        assert metric(st.ps[holder].url, "vllm:prefix_cache_hits_total") > hits


def test_with_kv_events_a_hit_from_p_s_own_cache_says_so(events_stack: StoreStack) -> None:
    """KV events tell P's own part from the store's: a turn the store gave nothing to (it was
    flushed; P's cache still holds the conversation) is `hit;via=prefill-cache`."""
    st = events_stack.st
    api = client(st.router.base_url)
    cid = f"ev-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": f"{cid}: {LONG}"}]
    p_of: dict[str, float] = {}

    def ask(question: str) -> str:
        messages.append({"role": "user", "content": question})
        before = {p.url: pulled_from_store(p.url) for p in st.ps}
        answer, reuse, _ = chat_turn(api, messages, cid=cid, max_tokens=MAX_TOKENS)
        assert answer == reference_answer(st.ref.url, messages, MAX_TOKENS)
        messages.append({"role": "assistant", "content": answer})
        p_of.update({u: pulled_from_store(u) - b for u, b in before.items()})
        return reuse

    assert ask("One?") == "miss;reason=no-session"
    indexed_now = {p.url: indexed(st, p.url) for p in st.ps}
    assert ask("Two?") == "hit;via=store"  # the previous answer's blocks came from the store
    assert sum(p_of.values()) > 0
    # Turn 2's P cached its prompt's new blocks: the router's index must know them first.
    served = next(u for u, n in p_of.items() if n > 0)
    wait_until(lambda: indexed(st, served) > indexed_now[served], "turn 2 not indexed")
    redis.Redis.from_url(events_stack.kv_url).flushdb()
    assert ask("Three?") == "hit;via=prefill-cache"
    assert sum(p_of.values()) == 0  # nothing came from the store


def pulled_from_store(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_responses_conversation_reads_its_history_from_the_store(
    ss: StoreStack, stream: bool
) -> None:
    """The Responses API: P's usage is `input_tokens_details`; the verdict reads it too."""
    st = ss.st
    api = client(st.router.base_url)
    cid = f"resp-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = []
    for turn in range(1, 4):
        items.append({"role": "user", "content": f"Reading {turn} {cid}: wind and rain?"})
        before = sum(pulled_from_store(p.url) for p in st.ps if p.proc.poll() is None)
        answer, reuse, _ = responses_turn(api, items, stream=stream, cid=cid)
        assert answer == responses_reference(st, items), f"turn {turn}"
        after = sum(pulled_from_store(p.url) for p in st.ps if p.proc.poll() is None)
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit;via=store", f"turn {turn}: {reuse}"
            assert after > before, f"turn {turn}: P read nothing from the store"
        items.append({"role": "assistant", "content": answer})


def test_a_conversation_without_an_id_is_found_by_its_history(ss: StoreStack) -> None:
    st = ss.st
    api = client(st.router.base_url)
    messages = [
        {"role": "system", "content": f"{uuid.uuid4().hex[:8]}: a terse assistant."},
        {"role": "user", "content": "Is it going to rain on the tea today?"},
    ]
    answer, reuse, _ = chat_turn(api, messages, cid=None, max_tokens=MAX_TOKENS)
    assert reuse == "miss;reason=no-session"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    answer, reuse, _ = chat_turn(api, messages, cid=None, max_tokens=MAX_TOKENS)
    assert reuse == "hit;via=store"
    assert answer == reference_chat(st, messages, MAX_TOKENS)
