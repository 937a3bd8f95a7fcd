"""The SSE relay and body capture: byte-identical pass-through, stripping, capture."""

from __future__ import annotations

import itertools
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.errors import SAMPLE_BYTES, MalformedAnswer
from router.turn.capture import Capture, Captured, decode_chunk
from router.turn.sse import SseRelay, capture_body

# D's own handle as vLLM returns it (vllm-cpu README section 4).
KV = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "d-engine",
    "remote_request_id": "chatcmpl-x-1a2b3c4d",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 70,
    "remote_blocks_expiry_time": 2095.3,
    "transfer_mode": "pull",
}
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
PROMPT_IDS = [1, 15043, 29892]
HEAD = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}


def enc(obj: Any) -> bytes:
    # vLLM (pydantic) writes compact JSON with raw UTF-8, as msgspec does.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def event(obj: Any, sep: bytes = b"\n\n") -> bytes:
    return b"data: " + enc(obj) + sep


def without(obj: dict[str, Any], *, token_ids: bool) -> dict[str, Any]:
    """What the client must see: obj minus kv_transfer_params (and token ids when asked)."""
    out = {k: v for k, v in obj.items() if k != "kv_transfer_params"}
    if token_ids:
        out.pop("prompt_token_ids", None)
        out["choices"] = [
            {k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")}
            for c in out["choices"]
        ]
    return out


def chat_chunks(pieces: list[str], *, kv: Any = KV) -> list[dict[str, Any]]:
    """A vLLM chat stream with return_token_ids and include_usage; kv in the final chunk."""
    first = {
        **HEAD,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": PROMPT_IDS,
    }
    chunks = [first]
    for i, text in enumerate(pieces):
        choice = {
            "index": 0,
            "delta": {"content": text},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": [100 + i],
        }
        chunks.append({**HEAD, "choices": [choice]})
    final = {
        "index": 0,
        "delta": {"content": ""},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
        "token_ids": [2],
    }
    chunks.append({**HEAD, "choices": [final], "kv_transfer_params": kv})
    chunks.append({**HEAD, "choices": [], "usage": USAGE})
    return chunks


def stream(chunks: list[dict[str, Any]], sep: bytes = b"\n\n") -> list[bytes]:
    return [event(c, sep) for c in chunks] + [b"data: [DONE]" + sep]


def relay(data: bytes | list[bytes], *, strip: bool = False) -> tuple[bytes, Captured]:
    r = SseRelay(strip_token_ids=strip)
    parts = [data] if isinstance(data, bytes) else data
    out = b"".join(r.feed(p) for p in parts) + r.flush()
    return out, r.captured


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(TEXT, min_size=1, max_size=8),
    strip=st.booleans(),
    data=st.data(),
)
def test_split_stream_equals_unsplit(pieces: list[str], strip: bool, data: st.DataObject) -> None:
    chunks = chat_chunks(pieces)
    events = stream(chunks)
    whole = b"".join(events)
    cuts = data.draw(st.lists(st.integers(0, len(whole)), max_size=20))
    out, cap = relay(split_at(whole, cuts), strip=strip)
    assert (out, cap) == relay(whole, strip=strip)
    assert (out, cap) == relay(events, strip=strip)  # one event per read: a paced D
    # Equal to the input apart from the stripped fields; untouched events are the same bytes.
    expected = []
    for chunk, raw in zip(chunks, events, strict=False):
        clean = without(chunk, token_ids=strip)
        expected.append(raw if clean == chunk else event(clean))
    expected.append(b"data: [DONE]\n\n")
    assert out == b"".join(expected)
    assert b"kv_transfer_params" not in out
    assert (events[1] in out) is not strip
    assert cap == Captured(
        kv_transfer_params=KV,
        finish_reason="stop",
        done=True,
        prompt_token_ids=PROMPT_IDS,
        output_token_ids=[100 + i for i in range(len(pieces))] + [2],
        output_text="".join(pieces),
        usage=USAGE,
    )


def test_one_byte_at_a_time_and_partial_events_are_held() -> None:
    whole = b"".join(stream(chat_chunks(["Hé", "llo 👋"])))
    r = SseRelay(strip_token_ids=False)
    outs = [r.feed(whole[i : i + 1]) for i in range(len(whole))]
    assert all(o == b"" for o in outs[:10])
    assert b"".join(outs) + r.flush() == relay(whole)[0]
    assert r.captured.output_text == "Héllo 👋"
    assert r.captured.output_text == "Héllo 👋"  # reading it twice gives the same text


def test_events_without_our_fields_pass_through_as_the_same_bytes() -> None:
    chunks = chat_chunks(["a", "b"])
    del chunks[-2]["kv_transfer_params"]
    # Odd but valid spacing and key order survive, since nothing is re-encoded.
    raw = b'data:  {"choices" : [ {"index":0, "delta":{"content":"x"}} ] }\n\n'
    tail = raw + b": keep-alive\n\n" + b"event: ping\n\n" + b"data: [DONE]\n\n"
    whole = b"".join(stream(chunks)[:-1]) + tail
    r = SseRelay(strip_token_ids=False)
    outs = [r.feed(piece) for piece in split_at(whole, [7, 200, 201, len(whole) - 20])]
    assert b"".join(outs) + r.flush() == whole
    assert all(out in whole for out in outs)
    assert r.captured.output_text == "abx"
    # Stripping token ids rewrites only the events that carry them.
    stripped, cap = relay(whole, strip=True)
    assert stripped.endswith(event(chunks[-1]) + tail)
    assert cap.output_token_ids == [100, 101, 2]


def test_null_kv_passes_as_sent_and_last_non_null_is_kept() -> None:
    chunks = chat_chunks(["a"])
    chunks[-1]["kv_transfer_params"] = None  # the usage chunk carries null after the handle
    events = stream(chunks)
    out, cap = relay(b"".join(events))
    assert events[-2] in out  # nothing to strip: D's bytes
    assert b'"kv_transfer_params":{' not in out
    assert cap.kv_transfer_params == KV


@pytest.mark.parametrize("strip", [False, True])
def test_a_033_stream_passes_its_null_keys_and_cuts_token_ids_from_the_bytes(strip: bool) -> None:
    """vLLM 0.33: every content chunk carries "kv_transfer_params":null, the finish chunk D's
    handle. Only the handle (and token ids the client did not ask for) is cut; the rest of
    each event is D's bytes, whatever their float spelling."""
    chunks = chat_chunks(["Hé", "llo", " 👋"])
    for chunk in chunks[1:4]:
        chunk["kv_transfer_params"] = None
    events = stream(chunks)
    events[1] = events[1].replace(b'"created":1', b'"created":1.50')  # not msgspec's spelling
    out, cap = relay(b"".join(events), strip=strip)
    assert relay(events, strip=strip) == (out, cap)  # one event per read: a paced D
    for raw, chunk in zip(events[1:4], chunks[1:4], strict=True):
        if not strip:
            assert raw in out
            continue
        cut = {
            **chunk,
            "choices": [{k: v for k, v in chunk["choices"][0].items() if k != "token_ids"}],
        }
        assert event(cut) in out.replace(b'"created":1.50', b'"created":1')
    assert b'"created":1.50' in out and out.count(b'"kv_transfer_params":null') == 3
    assert (b"token_ids" in out) is not strip
    assert b'"kv_transfer_params":{' not in out
    assert cap.kv_transfer_params == KV and cap.output_text == "Héllo 👋"


@pytest.mark.parametrize(
    ("raw", "sent"),
    [
        # vLLM 0.33's content chunk with the ids the router asked for: cut from the bytes
        (
            b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7]}],'
            b'"kv_transfer_params":null}\n\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],'
            b'"kv_transfer_params":null}\n\n',
        ),
        (
            b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":null}]}\n\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
        ),
        # both ids, several ids: every member cut
        (
            b'data: {"choices":[{"index":0,"text":"a","prompt_token_ids":[1,2],'
            b'"token_ids":[7,8]}]}\n\n',
            b'data: {"choices":[{"index":0,"text":"a"}]}\n\n',
        ),
        # ids spelled otherwise than vLLM writes them: decoded and re-encoded
        (
            b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids": [ 7 ]}]}\n\n',
            b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
        ),
        # a CR inside the event is a line end (SSE): not the one-line shape
        (b"data: [DONE]\r\n\n", b"data: [DONE]\r\n\n"),
    ],
)
def test_one_event_per_read_is_cut_like_a_whole_stream(raw: bytes, sent: bytes) -> None:
    r = SseRelay(strip_token_ids=True)
    assert r.feed(raw) + r.flush() == sent
    assert relay(raw + raw, strip=True)[0] == sent + sent
    assert r.captured.output_text in ("a", "")


ONE_EVENT_READS = [
    # vLLM 0.33's chunks: the null key passes, the one id list is cut
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7]}],'
    b'"kv_transfer_params":null}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[]}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7,8]}]}\n\n',
    b'data: {"prompt_token_ids":[1,2],"choices":[{"index":0,"delta":{"content":"a"},'
    b'"token_ids":[7]}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7]},'
    b'{"index":1,"delta":{"content":"b"},"token_ids":[8]}]}\n\n',
    # the member's name inside a string, ids spelled otherwise, a handle, two keys
    b'data: {"choices":[{"index":0,"delta":{"content":"\\",\\"token_ids\\":[1]"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[ 7]}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7}]}\n\n',
    b'data: {"choices":[],"kv_transfer_params":{"remote_engine_id":"d"}}\n\n',
    b'data: {"kv_transfer_params":null,"choices":[],"kv_transfer_params":{"a":1}}\n\n',
    b'data: {"choices":[],"kv_transfer_params":nul}\n\n',
    # CRs end lines (SSE); other fields; no space after the colon; not JSON; [DONE]
    b"data: [DONE]\r\n\n",
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\rdata: x\n\n',
    b'event: x\ndata: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    b'data:{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7]}]}\n\n',
    b"data: not json\n\n",
    b": a comment\n\n",
    b"data: [DONE]\n\n",
]


@pytest.mark.parametrize("strip", [True, False])
@pytest.mark.parametrize("raw", ONE_EVENT_READS)
def test_a_read_of_one_event_is_relayed_as_the_general_path_relays_it(
    raw: bytes, strip: bool
) -> None:
    """A read of one whole event (every read of a paced D) takes a shorter path; a read of
    part of it takes the general one. Both forward and capture the same."""
    r = SseRelay(strip_token_ids=strip)
    out = r.feed(raw)
    assert out  # a whole event leaves at once
    out += r.flush()
    general = SseRelay(strip_token_ids=strip)
    parts = general.feed(raw[:3]) + general.feed(raw[3:]) + general.flush()
    assert out == parts
    assert (r.done, r.captured) == (general.done, general.captured)


def test_crlf_stream() -> None:
    chunks = chat_chunks(["x", "ÿ"])
    whole = b"".join(stream(chunks, b"\r\n\r\n"))
    responses_event = b"event: response.completed\r\n" + event(
        {
            "type": "response.completed",
            "response": {"status": "completed", "kv_transfer_params": KV},
        },
        b"\r\n\r\n",
    )
    out, cap = relay(split_at(whole + responses_event, [5, 66, len(whole) - 1, len(whole) + 3]))
    lines = out.split(b"\r\n\r\n")
    assert lines[-1] == b"" and len(lines) == len(chunks) + 3
    assert b"kv_transfer_params" not in out
    assert lines[0] == whole.split(b"\r\n\r\n")[0]
    assert lines[-2] == (
        b"event: response.completed\r\n"
        b'data: {"type":"response.completed","response":{"status":"completed"}}'
    )
    assert b"\n\n" not in out
    assert (cap.output_text, cap.done, cap.kv_transfer_params) == ("xÿ", True, KV)


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (
            b'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}',
            {"message": "boom", "type": "InternalServerError", "code": 500},
        ),
        (
            b'data: {"object":"error","message":"bad","type":"BadRequestError","code":400}',
            {"message": "bad", "type": "BadRequestError", "code": 400},
        ),
        (
            b'event: error\ndata: {"type":"error","code":"x","message":"m","sequence_number":3}',
            {"message": "m", "type": "error", "code": "x"},
        ),
        (
            b'event: response.failed\ndata: {"type":"response.failed","response":'
            b'{"status":"failed","error":{"code":"server_error","message":"m"}}}',
            {"code": "server_error", "message": "m"},
        ),
    ],
)
def test_error_events_are_captured_and_passed_through(raw: bytes, error: dict[str, Any]) -> None:
    whole = event({**HEAD, "choices": [{"index": 0, "delta": {"content": "a"}}]}) + raw + b"\n\n"
    out, cap = relay(split_at(whole, [len(whole) - 5]))
    assert out == whole
    assert cap.error == error
    assert not cap.done


@pytest.mark.parametrize(
    "raw",
    [
        b"data: hello world\n\n",
        b"data: {broken\n\n",
        b"data: [1, 2]\n\n",
        b'data: "s"\n\n',
        b"data: \xff\xfe\n\n",
        b"data:\n\n",
        b": comment only\n\n",
        b"id: 7\nretry: 10\n\n",
        b"\n\n",
        b'data: {"choices": 5}\n\n',
        b'data: {"choices": [{"delta": "x"}]}\n\n',
        b'data: {"x": {"kv_transfer_params": {"a": 1}}}\n\n',  # only top-level keys are ours
        b'data: [{"kv_transfer_params": 1}]\n\n',
        b'data: {"type": 5}\n\n',
        b'data: {"type": "response.output_text.delta", "delta": 5}\n\n',
    ],
)
def test_odd_events_pass_through_untouched(raw: bytes) -> None:
    out, cap = relay(raw + b"data: [DONE]\n\n")
    assert out == raw + b"data: [DONE]\n\n"
    assert cap == Captured(done=True)


def test_kv_is_stripped_even_from_chunks_of_an_unexpected_shape() -> None:
    raw = event({"choices": 5, "kv_transfer_params": KV})
    out, cap = relay(raw)
    assert out == b'data: {"choices":5}\n\n'
    assert cap.kv_transfer_params is None  # nothing captured from a chunk we cannot read


def test_data_without_space_and_multiline_data() -> None:
    a = b"data:" + enc({**HEAD, "choices": [{"index": 0, "delta": {"content": "p"}}]}) + b"\n\n"
    body = enc({"choices": [], "usage": USAGE, "kv_transfer_params": KV})
    b = b"id: 9\ndata: " + body[:10] + b"\ndata: " + body[10:] + b"\n\n"
    out, cap = relay([a, b])
    assert out == a + b'id: 9\ndata: {"choices":[],"usage":' + enc(USAGE) + b"}\n\n"
    assert (cap.output_text, cap.usage, cap.kv_transfer_params) == ("p", USAGE, KV)


def test_flush_strips_a_last_event_without_its_blank_line() -> None:
    raw = event({**HEAD, "choices": [], "kv_transfer_params": KV}, b"\n")
    r = SseRelay(strip_token_ids=False)
    assert r.feed(raw) == b""
    assert r.flush() == b"data: " + enc({**HEAD, "choices": []})
    assert r.captured.kv_transfer_params == KV
    assert r.flush() == b""
    truncated = SseRelay(strip_token_ids=False)
    assert truncated.feed(b'data: {"choi') == b""
    assert truncated.flush() == b'data: {"choi'


def test_completions_stream_token_ids_and_second_choice() -> None:
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "tiny"}
    chunks = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "text": "Hi",
                    "logprobs": None,
                    "finish_reason": None,
                    "prompt_token_ids": PROMPT_IDS,
                    "token_ids": [5],
                }
            ],
        },
        {
            **head,
            "choices": [{"index": 1, "text": "NO", "finish_reason": "error", "token_ids": [9]}],
        },
        {
            **head,
            "choices": [{"index": 0, "text": "!", "finish_reason": "length", "token_ids": [6]}],
        },
    ]
    whole = b"".join(stream(chunks))
    kept, cap = relay(whole, strip=False)
    assert kept == whole
    stripped, cap2 = relay(whole, strip=True)
    assert b"token_ids" not in stripped
    assert stripped == b"".join(stream([without(c, token_ids=True) for c in chunks]))
    for c in (cap, cap2):
        assert (c.output_text, c.finish_reason, c.prompt_token_ids, c.output_token_ids) == (
            "Hi!",
            "length",
            PROMPT_IDS,
            [5, 6],
        )


@pytest.mark.parametrize(
    ("delta", "reasoning", "tool_calls"),
    [
        ({"reasoning_content": "hmm"}, True, False),
        ({"reasoning": "hmm"}, True, False),
        ({"reasoning": None, "content": "a"}, False, False),
        ({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}, False, True),
        ({"tool_calls": []}, False, False),
    ],
)
def test_reasoning_and_tool_calls(delta: dict[str, Any], reasoning: bool, tool_calls: bool) -> None:
    _, cap = relay(event({**HEAD, "choices": [{"index": 0, "delta": delta}]}))
    assert (cap.reasoning, cap.tool_calls) == (reasoning, tool_calls)


def responses_stream(*, status: str = "completed", details: Any = None) -> list[bytes]:
    def ev(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\n".encode() + event({"type": kind, **fields, "sequence_number": 0})

    base = {
        "id": "resp_1",
        "object": "response",
        "status": "in_progress",
        "kv_transfer_params": None,
    }
    final = {
        **base,
        "status": status,
        "incomplete_details": details,
        "usage": USAGE,
        "kv_transfer_params": KV,
    }
    return [
        ev("response.created", response=base),
        ev("response.in_progress", response=base),
        ev("response.reasoning_text.delta", delta="think"),
        ev("response.output_item.added", output_index=0, item={"type": "message"}),
        ev("response.output_text.delta", item_id="m", output_index=0, delta="Grüß"),
        ev("response.output_text.delta", item_id="m", output_index=0, delta=" 🌍"),
        ev("response.output_text.done", item_id="m", output_index=0, text="Grüß 🌍"),
        ev("response.completed", response=final),
    ]


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_responses_api_stream(data: st.DataObject) -> None:
    events = responses_stream()
    whole = b"".join(events)
    cuts = data.draw(st.lists(st.integers(0, len(whole)), max_size=10))
    out, cap = relay(split_at(whole, cuts))
    assert b'"kv_transfer_params":{' not in out  # the handle; vLLM's null passes as sent
    for untouched in events[:7]:
        assert untouched in out
    completed = out.split(b"\n\n")[-2]
    assert completed.startswith(b"event: response.completed\ndata: ")
    assert json.loads(completed.split(b"data: ", 1)[1])["response"]["usage"] == USAGE
    # The response object as D ended it (its handle in it), for the router's response store.
    assert cap.response is not None
    assert json.loads(cap.response)["kv_transfer_params"] == KV
    assert json.loads(cap.response)["usage"] == USAGE
    assert msgspec.structs.replace(cap, response=None) == Captured(
        kv_transfer_params=KV,
        finish_reason="stop",
        output_text="Grüß 🌍",
        reasoning=True,
        usage=USAGE,
    )
    # Responses streams end without [DONE]; the completed event is the end.


@pytest.mark.parametrize(
    ("status", "details", "finish"),
    [
        ("completed", None, "stop"),
        ("incomplete", {"reason": "max_output_tokens"}, "length"),
        ("incomplete", None, "length"),
        ("incomplete", {"reason": "content_filter"}, "content_filter"),
        ("in_progress", None, None),
    ],
)
def test_responses_finish_reason(status: str, details: Any, finish: str | None) -> None:
    _, cap = relay(b"".join(responses_stream(status=status, details=details)))
    assert cap.finish_reason == finish


RAW = "raw_message_tokens"
MESSAGES = {
    "input_messages": [{"message": "<p>", "tokens": [1, 5, 6], "type": RAW}],
    "output_messages": [{"message": "ok", "tokens": [7, 8], "type": RAW}],
}


@pytest.mark.parametrize("strip", [True, False])
def test_responses_token_ids_are_captured_and_cut_unless_the_client_asked(strip: bool) -> None:
    """enable_response_messages (asked by the router): D's prompt and output ids from
    response.completed (stream) or the body; the client sees null, as without the flag."""
    final = {"status": "completed", "kv_transfer_params": KV, **MESSAGES}
    kind = "response.completed"
    raw = f"event: {kind}\n".encode() + event({"type": kind, "response": final})
    r = SseRelay(strip_token_ids=strip, responses=True)
    out = r.feed(raw) + r.flush()
    cap = r.captured
    sent = json.loads(out.split(b"data: ", 1)[1])["response"]
    assert cap.prompt_token_ids == [1, 5, 6] and cap.output_token_ids == [7, 8]
    assert "kv_transfer_params" not in sent
    assert sent["input_messages"] == (None if strip else MESSAGES["input_messages"])
    assert sent["output_messages"] == (None if strip else MESSAGES["output_messages"])
    body = enc({"object": "response", "status": "completed", **MESSAGES})
    client, cap2 = capture_body(body, strip_token_ids=strip)
    assert cap2.prompt_token_ids == [1, 5, 6] and cap2.output_token_ids == [7, 8]
    assert (json.loads(client)["input_messages"] is None) is strip


@pytest.mark.parametrize(
    "messages",
    [
        {"input_messages": None, "output_messages": None},  # not asked: vLLM's null
        {  # a tool loop's several requests: no single sequence D holds
            "input_messages": MESSAGES["input_messages"],
            "output_messages": MESSAGES["output_messages"] * 2,
        },
        {  # Harmony messages, not raw tokens
            "input_messages": [{"role": "user", "content": "x"}],
            "output_messages": [],
        },
    ],
)
def test_responses_token_ids_of_other_shapes_are_not_captured(messages: dict[str, Any]) -> None:
    body = enc({"object": "response", "status": "completed", **messages})
    _, cap = capture_body(body, strip_token_ids=True)
    assert cap.prompt_token_ids is None and cap.output_token_ids == []


def test_responses_function_call_event() -> None:
    kind = "response.function_call_arguments.delta"
    raw = f"event: {kind}\n".encode() + event({"type": kind, "delta": "{"})
    out, cap = relay(raw)
    assert out == raw
    assert cap.tool_calls and cap.output_text == ""


# Non-streaming bodies.

CHAT_BODY = {
    "id": "chatcmpl-x",
    "object": "chat.completion",
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Höla", "reasoning": None},
            "finish_reason": "length",
            "token_ids": [7, 8],
        }
    ],
    "usage": USAGE,
    "prompt_token_ids": PROMPT_IDS,
    "kv_transfer_params": KV,
}


@pytest.mark.parametrize(
    ("body", "strip", "client_body", "expected"),
    [
        (
            CHAT_BODY,
            False,
            without(CHAT_BODY, token_ids=False),
            Captured(
                kv_transfer_params=KV,
                finish_reason="length",
                prompt_token_ids=PROMPT_IDS,
                output_token_ids=[7, 8],
                output_text="Höla",
                usage=USAGE,
            ),
        ),
        (
            CHAT_BODY,
            True,
            without(CHAT_BODY, token_ids=True),
            Captured(
                kv_transfer_params=KV,
                finish_reason="length",
                prompt_token_ids=PROMPT_IDS,
                output_token_ids=[7, 8],
                output_text="Höla",
                usage=USAGE,
            ),
        ),
        (
            {
                **CHAT_BODY,
                "kv_transfer_params": None,
                "choices": [
                    {
                        "index": 0,
                        "message": {"content": None, "tool_calls": [{"id": "t"}]},
                        "finish_reason": "tool_calls",
                    }
                ],
            },
            False,
            {
                **without(CHAT_BODY, token_ids=False),
                "choices": [
                    {
                        "index": 0,
                        "message": {"content": None, "tool_calls": [{"id": "t"}]},
                        "finish_reason": "tool_calls",
                    }
                ],
            },
            Captured(
                finish_reason="tool_calls",
                prompt_token_ids=PROMPT_IDS,
                tool_calls=True,
                usage=USAGE,
            ),
        ),
        (
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "choices": [
                    {
                        "index": 0,
                        "text": "ok",
                        "finish_reason": "stop",
                        "prompt_token_ids": [1],
                        "token_ids": [3],
                    }
                ],
                "usage": USAGE,
                "kv_transfer_params": KV,
            },
            True,
            {
                "id": "cmpl-x",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": USAGE,
            },
            Captured(
                kv_transfer_params=KV,
                finish_reason="stop",
                prompt_token_ids=[1],
                output_token_ids=[3],
                output_text="ok",
                usage=USAGE,
            ),
        ),
        (
            {
                "id": "resp_1",
                "object": "response",
                "status": "completed",
                "usage": USAGE,
                "output": [
                    {"type": "reasoning", "content": []},
                    {
                        "type": "message",
                        "content": [
                            {"type": "output_text", "text": "A"},
                            {"type": "output_text", "text": "B"},
                        ],
                    },
                    "junk",
                ],
                "kv_transfer_params": KV,
            },
            False,
            {
                "id": "resp_1",
                "object": "response",
                "status": "completed",
                "usage": USAGE,
                "output": [
                    {"type": "reasoning", "content": []},
                    {
                        "type": "message",
                        "content": [
                            {"type": "output_text", "text": "A"},
                            {"type": "output_text", "text": "B"},
                        ],
                    },
                    "junk",
                ],
            },
            Captured(
                kv_transfer_params=KV,
                finish_reason="stop",
                output_text="AB",
                reasoning=True,
                usage=USAGE,
            ),
        ),
        (
            {
                "object": "response",
                "status": "incomplete",
                "output": [{"type": "function_call"}],
                "incomplete_details": {"reason": "max_output_tokens"},
            },
            False,
            None,
            Captured(finish_reason="length", tool_calls=True),
        ),
        (
            {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}},
            False,
            None,
            Captured(
                error={"message": "no", "type": "BadRequestError", "param": None, "code": 400}
            ),
        ),
    ],
)
def test_capture_body(body: Any, strip: bool, client_body: Any, expected: Captured) -> None:
    raw = enc(body)
    out, cap = capture_body(raw, strip_token_ids=strip)
    if body.get("object") == "response":  # kept as the client got it (the response store)
        expected = msgspec.structs.replace(expected, response=out)
    if client_body is None:
        assert out is raw  # nothing of ours in it: the very same bytes
    else:
        assert json.loads(out) == client_body
        assert list(json.loads(out)) == list(client_body)  # key order kept
    assert cap == expected


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"{",
        b"\xff",
        b"<html><body>502 Bad Gateway</body></html>",
        b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"content":"hal',
        b"[1, 2]",
        b'{"choices": "x", "kv_transfer_params": {}}',
        b'{"id": "x"}',
    ],
)
def test_a_body_that_is_not_a_response_object_is_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedAnswer) as caught:
        capture_body(raw, strip_token_ids=True)
    assert caught.value.sample == raw[:SAMPLE_BYTES]


def test_capture_body_keeps_floats_and_unicode() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"content": '€ \\u0000 "q"'},
                "logprobs": {"content": [{"logprob": -1.2345678901234567e-05}]},
            }
        ],
        "kv_transfer_params": None,
    }
    out, _ = capture_body(enc(body), strip_token_ids=False)
    assert msgspec.json.decode(out) == {k: v for k, v in body.items() if k != "kv_transfer_params"}


@pytest.mark.parametrize("odd_at", [None, 3, 70, 150])
def test_a_long_stream_is_captured_in_batches_and_odd_events_alone(odd_at: int | None) -> None:
    """Events are captured in batches (CAPTURE_BATCH at a time): a long stream's text, token
    ids and handle whole; an event of another shape, not JSON, or two JSON values in one
    event, captured as nothing, and only it."""
    pieces = [f"w{i} " for i in range(200)]
    events = stream(chat_chunks(pieces))
    if odd_at is not None:
        events[odd_at:odd_at] = [
            b'data: {"choices": "not a list"}\n\n',
            b"data: not json\n\n",
            b'data: {"choices":[{"index":0,"delta":{"content":"X"}}]},{"a":1}\n\n',
        ]
    out, cap = relay(events, strip=True)
    assert cap.output_text == "".join(pieces) and cap.done and cap.kv_transfer_params == KV
    assert cap.output_token_ids == [100 + i for i in range(200)] + [2]
    assert relay(b"".join(events), strip=True) == (out, cap)
    if odd_at is not None:
        assert b"data: not json\n\n" in out and b'"not a list"' in out


def _choice(**fields: Any) -> dict[str, Any]:
    return {
        "index": 0,
        "delta": {"content": "a"},
        "logprobs": None,
        "finish_reason": None,
        **fields,
    }


# A streamed token's chunk, and chunks that differ from it in one field each.
CAPTURED_CHUNKS: list[dict[str, Any]] = [
    {**HEAD, "choices": [_choice(token_ids=[7])], "kv_transfer_params": None},
    {**HEAD, "choices": [_choice(token_ids=None)]},
    {**HEAD, "choices": [_choice()]},
    {**HEAD, "choices": [_choice(token_ids=[7, 8])]},
    {**HEAD, "choices": [_choice(token_ids=[True])]},
    {**HEAD, "choices": [_choice(token_ids=["7"])]},
    {**HEAD, "choices": [_choice(token_ids=[])]},
    {**HEAD, "choices": [_choice(token_ids=[9], finish_reason="stop")], "kv_transfer_params": KV},
    {**HEAD, "choices": [_choice(token_ids=[9], finish_reason="length")]},
    {**HEAD, "choices": [_choice(token_ids=[9])], "kv_transfer_params": KV},
    {**HEAD, "choices": [_choice(text="t", token_ids=[9])]},
    {"object": "error", "message": "m", "choices": [_choice(token_ids=[9])]},
    {"type": "error", "message": "m", "choices": [_choice(token_ids=[9])]},
    {**HEAD, "choices": [_choice(index=1, token_ids=[5])]},
    {**HEAD, "choices": [_choice(token_ids=[6]), _choice(index=1, token_ids=[5])]},
    {**HEAD, "choices": [_choice(token_ids=[4], prompt_token_ids=[1, 2])]},
    {**HEAD, "choices": [{"index": 0, "text": "b", "token_ids": [3]}]},
    {**HEAD, "choices": [_choice(delta={"reasoning": "r"}, token_ids=[2])]},
    {**HEAD, "choices": [_choice(delta={"reasoning_content": ""}, token_ids=[2])]},
    {**HEAD, "choices": [_choice(delta={"tool_calls": [{"id": "t"}]}, token_ids=[2])]},
    {**HEAD, "choices": [_choice(delta={"content": 5}, token_ids=[2])]},
    {**HEAD, "choices": [_choice(delta=None, message={"content": "m"})]},
    {**HEAD, "choices": [_choice(token_ids=[1])], "prompt_token_ids": PROMPT_IDS},
    {**HEAD, "choices": [], "usage": USAGE},
    {**HEAD, "choices": [_choice(token_ids=[1])], "usage": "odd"},
    {"object": "error", "message": "m", "type": "t", "code": 1},
    {"error": {"message": "e"}},
    {"type": "response.output_text.delta", "delta": "x"},
    {
        "type": "response.completed",
        "response": {
            "status": "completed",
            "input_messages": [{"type": "raw_message_tokens", "tokens": [1, 2]}],
            "output_messages": [{"type": "raw_message_tokens", "tokens": [3]}],
        },
    },
]


def test_every_pair_of_chunks_is_captured_in_a_batch_as_chunk_by_chunk() -> None:
    for pair in itertools.product(CAPTURED_CHUNKS, repeat=2):
        _batch_equals_single(list(pair))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(CAPTURED_CHUNKS), max_size=12))
def test_a_batch_of_chunks_is_captured_as_chunk_by_chunk(picked: list[dict[str, Any]]) -> None:
    _batch_equals_single(picked)


def _batch_equals_single(picked: list[dict[str, Any]]) -> None:
    """The batch capture's shorter path for a streamed token's chunk reads what the
    general one reads, whatever comes before and after it."""
    batch, single = Capture(), Capture()
    batch.chunks([decode_chunk(enc(c)) for c in picked])
    for c in picked:  # decoded again: a capture may keep (and extend) a decoded list
        single.chunk(decode_chunk(enc(c)))
    assert batch.result() == single.result()


_TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
_LAST = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
_COMPLETED = b'data: {"type":"response.completed","response":{"status":"completed"}}\n\n'


@pytest.mark.parametrize(
    ("stream", "responses", "problem"),
    [
        ([_TOKEN, _LAST, b"data: [DONE]\n\n"], False, None),
        ([_TOKEN, _LAST], False, "without its terminator"),
        ([_TOKEN, _LAST[:30]], False, "without its terminator"),
        ([_TOKEN, b"data: <html>oops</html>\n\n", _LAST, b"data: [DONE]\n\n"], False, "not JSON"),
        ([_TOKEN, b'data: {"error":{"message":"boom"}}\n\n'], False, None),
        ([b'data: {"type":"response.output_text.delta","delta":"a"}\n\n', _COMPLETED], True, None),
        ([b'data: {"type":"response.output_text.delta","delta":"a"}\n\n'], True, "terminator"),
    ],
)
def test_a_stream_unlike_the_api_is_malformed_at_its_end(
    stream: list[bytes], responses: bool, problem: str | None
) -> None:
    relay = SseRelay(strip_token_ids=False, responses=responses)
    for chunk in stream:
        relay.feed(chunk)
    tail = relay.flush()
    if problem is None:
        relay.check(at_end=True, sample=tail)
        return
    with pytest.raises(MalformedAnswer, match=problem):
        relay.check(at_end=True, sample=tail)
