"""The demo's scripted chat and its table: each turn streamed twice, once in a conversation the
router keeps (reuse) and once as a conversation of its own (a new id each turn: no reuse, what
a stateless P/D proxy gets), with the time to the first content chunk and the prompt tokens
computed for each; then a summary of what reuse saved."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from router.errors import DemoError

MODEL = "sim-model"  # the simulator's default served model name
MAX_TOKENS = 96
API_KEY = "demo-key"  # the demo's bearer token: its tenant (any value; the router checks none)

SYSTEM_PROMPT = (
    "You are the support assistant of a small company that rents bicycles to visitors of an old "
    "harbour town. Answer in a friendly and short way, in plain words, and never invent prices or "
    "opening hours that are not written here. The shop opens at nine in the morning and closes at "
    "seven in the evening, every day of the week except on the first day of the year. A city bike "
    "costs twelve euros for half a day and twenty euros for a whole day. An electric bike costs "
    "twenty five euros for half a day and forty euros for a whole day. Children ride free on a "
    "seat behind a parent, and a helmet and a lock come with every bike at no extra cost. A "
    "customer who brings a bike back late pays five euros for every started hour. Groups of more "
    "than six people should book a day ahead, because the shop keeps only thirty bikes. The coast "
    "road to the lighthouse is flat and takes about forty minutes each way; the forest path over "
    "the hill is steep, muddy after rain and best done on an electric bike. There is a bakery at "
    "the lighthouse and a lake with a small beach halfway along the forest path. When a customer "
    "asks for a route, name the road, the time it takes and one place to stop. Keep every answer "
    "under five sentences, and end by asking whether the customer needs anything else."
)
QUESTIONS = (
    "Hello! We are two adults and one child. What would a day of cycling cost us?",
    "Which route would you suggest for a sunny afternoon?",
    "And if it rained this morning, is the forest path still a good idea?",
    "Great. Can we bring the bikes back at eight in the evening?",
)
COSTS = """simulated costs: 0.5 ms per computed prompt token,
            0.05 ms per KV block moved, 2 ms per generated token"""
LEGEND = f"""
  TTFT      time to the first streamed content chunk ({COSTS})
  computed  prompt tokens prefilled: the prompt less usage's cached_tokens (its own prefix
            cache plus the KV read from D)
  hit       the router gave P the previous turn's KV handle from D (the baton);
            hit;via=decode: D, which held the conversation, ran the whole turn, no P leg
  no reuse  the same turn as a conversation of its own (a new id each turn): P keeps its own
            prefix cache of the last prompt, never the answer D generated
"""
PUSH_LEGEND = f"""
  TTFT      time to the first streamed content chunk: P and D called together, P writes D the
            blocks D lacks ({COSTS})
  computed  prompt tokens prefilled: the prompt less usage's cached_tokens
  push-affinity  no D->P reuse in push mode (vllm#46473): the same P and D keep the
            conversation in their prefix caches, so P computes and writes only the new turn
"""


@dataclass
class Row:
    """One streamed turn as the table shows it."""

    ttft_ms: float
    reuse: str
    prompt: int
    computed: int
    answer: str


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: dict[str, Any] | None = None


_chunk = msgspec.json.Decoder(_Chunk).decode


async def streamed_turn(
    http: aiohttp.ClientSession, url: str, conv_id: str, messages: list[dict[str, str]]
) -> Row:
    """A streamed chat turn, timed to its first content chunk, with usage from its last."""
    body = dict(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        conversation_id=conv_id,
        stream=True,
        stream_options={"include_usage": True},
    )
    headers = {"Authorization": f"Bearer {API_KEY}"}
    started = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise DemoError(f"the router answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue  # blank separators, data: [DONE]
            chunk = _chunk(line[6:])
            piece = "".join(c.delta.content or "" for c in chunk.choices if c.delta)
            if piece and first is None:
                first = time.perf_counter()
            text.append(piece)
            usage = chunk.usage or usage
        reuse = resp.headers.get("X-KV-Reuse", "-")
    prompt = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    ttft = ((first or time.perf_counter()) - started) * 1000
    return Row(ttft, reuse, prompt, prompt - cached, "".join(text))


def first_words(text: str, count: int = 6) -> str:
    words = text.split()
    return " ".join(words[:count]) + (" ..." if len(words) > count else "")


def system(tag: str) -> dict[str, str]:
    """The system prompt, opened by a tag of the conversation's own: the two conversations
    share no prefix, so neither finds the other's blocks in a prefix cache."""
    return {"role": "system", "content": f"[chat {tag}] {SYSTEM_PROMPT}"}


def twin(conv_id: str) -> str:
    """The tag of the conversation beside `conv_id`: every digit shifted by one. The
    simulator's tokenizer makes each digit one token, so both prompts are the same size (a
    random hex id was not always: its letters may form a word, one token, or stay bytes), and
    they differ from the tag's first digit on, so neither finds the other's blocks."""
    return "".join(str((int(c) + 1) % 10) if c.isdigit() else c for c in conv_id)


async def converse(url: str, conv_id: str, connector: str = "nixl") -> list[tuple[Row, Row]]:
    """The scripted chat, each turn resending the whole history as chat clients do; beside
    each turn, the same messages in a conversation of their own. (reuse, no reuse) per turn."""
    print(
        f"\nA {len(QUESTIONS)}-turn chat, streamed, as conversation_id={conv_id!r} and, beside "
        "it, the same turns without reuse\n(a new conversation id each turn):\n"
    )
    print(
        f"  {'turn':>4} {'prompt':>6}  {'TTFT':>6} {'computed':>8}  {'X-KV-Reuse':<24}"
        f" | no reuse: {'TTFT':>6} {'computed':>8}  answer"
    )
    rows: list[tuple[Row, Row]] = []
    history: list[dict[str, str]] = []
    alone = twin(conv_id)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for turn, question in enumerate(QUESTIONS, start=1):
            history.append({"role": "user", "content": question})
            kept = await streamed_turn(http, url, conv_id, [system(conv_id), *history])
            single = await streamed_turn(
                http, url, f"{conv_id}-alone-{turn}", [system(alone), *history]
            )
            history.append({"role": "assistant", "content": kept.answer})
            rows.append((kept, single))
            print(
                f"  {turn:>4} {kept.prompt:>6}  {kept.ttft_ms:>3.0f} ms {kept.computed:>8}  "
                f"{kept.reuse:<24} |           {single.ttft_ms:>3.0f} ms {single.computed:>8}"
                f"  {first_words(kept.answer)}"
            )
    print(LEGEND if connector == "nixl" else PUSH_LEGEND)
    return rows


def summary(rows: list[tuple[Row, Row]]) -> str:
    """What the table showed, in one sentence: turns 2 on, with reuse against without."""
    later = rows[1:]
    if not later:
        return ""
    kept = [r for r, _ in later]
    alone = [r for _, r in later]
    ttft = sum(r.ttft_ms for r in kept) / len(kept)
    ttft_alone = sum(r.ttft_ms for r in alone) / len(alone)
    reuses = ", ".join(sorted({r.reuse for r in kept}))
    return (
        f"Turns 2-{len(rows)} ({reuses}): {sum(r.computed for r in kept)} prompt tokens "
        f"computed with reuse, {sum(r.computed for r in alone)} without; time to first token "
        f"{ttft:.0f} ms with reuse, {ttft_alone:.0f} ms without (mean)."
    )
