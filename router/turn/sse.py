"""D's response relayed to the client: strip router-only fields, capture what the turn needs.

The stream relay passes every event it does not change through as the original bytes: vLLM
0.33's `"kv_transfer_params":null` in each content chunk is D's own shape, not a handle, and
passes as it came; token ids the client did not ask for are cut out of the bytes.
"""

from __future__ import annotations

import contextlib

import msgspec

from router.errors import MalformedAnswer
from router.turn.capture import (
    Capture,
    Captured,
    Chunk,
    Response,
    decode_chunk,
    responses_output,
)
from router.turn.strip import (
    KV_KEY,
    NULL_KV,
    RAW_MESSAGES,
    TOKEN_IDS_KEY,
    cut_every_id,
    cut_ids,
    strip_fields,
    strippable_kv,
)

_LF = b"\n\n"
_CRLF = b"\r\n\r\n"


def _data_of(block: bytes) -> bytes | None:
    """The data of one event (its `data:` lines joined by \\n), or None if it has none."""
    if b"\n" not in block and b"\r" not in block:  # the usual single-line event
        if block.startswith(b"data: "):
            return block[6:]
        return block[5:] if block.startswith(b"data:") else None
    parts = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in block.splitlines()
        if line.startswith(b"data:")
    ]
    return b"\n".join(parts) if parts else None


def _with_data(block: bytes, data: bytes, eol: bytes) -> bytes:
    """The event's other lines (event:, id:, comments) kept; its data lines replaced by one."""
    if block.startswith(b"data:") and b"\n" not in block and b"\r" not in block:
        return b"data: " + data
    out: list[bytes] = []
    for line in block.splitlines():
        if not line.startswith(b"data:"):
            out.append(line)
        elif data:
            out.append(b"data: " + data)
            data = b""
    return eol.join(out)


_decode_any = msgspec.json.Decoder().decode
_decode_chunks = msgspec.json.Decoder(list[Chunk]).decode
CAPTURE_BATCH = 64  # events decoded at once: one call per batch, a long stream's bytes bounded
_encode = msgspec.json.Encoder().encode


class SseRelay:
    """Incremental relay of D's SSE stream: complete events out, a partial event held."""

    def __init__(self, *, strip_token_ids: bool, responses: bool = False) -> None:
        self._strip_ids = strip_token_ids
        # A Responses stream's token ids are in response.completed's input_messages and
        # output_messages (looked for only there: no extra scan of a chat stream's chunks).
        self._strip_raw = strip_token_ids and responses
        self._capture = Capture()
        self.bad = b""  # the first event data seen that is not JSON (seen when decoded)
        self._pending: list[bytes] = []  # events' data not captured yet (decoded in batches)
        self._done = False
        self._held = bytearray()
        self._scan_from = 0  # where to resume looking for a blank line in _held
        self._first, self._second = _LF, _CRLF  # the separator seen last is looked for first

    @property
    def done(self) -> bool:
        """`[DONE]` was seen (cheap: read on every chunk, unlike `captured`)."""
        return self._done

    @property
    def captured(self) -> Captured:
        """What was captured so far; joins the output text, so read it once at the end."""
        self._capture_pending()
        self._capture.cap.done = self._done
        return self._capture.result()

    def _capture_pending(self) -> None:
        """Decode the held events' data in one call and capture them. Per event, the relay
        only keeps its bytes: a decode and a capture per chunk, in the middle of other work,
        cost a paced chunk more CPU than the same done for a batch at once (measured)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            chunks = _decode_chunks(b"[" + b",".join(pending) + b"]")
        except (msgspec.ValidationError, msgspec.DecodeError):
            chunks = []
        if len(chunks) != len(pending):  # an event of another shape, or not JSON: one by one
            chunks = []
            for data in pending:
                try:
                    chunks.append(decode_chunk(data))
                except msgspec.ValidationError:
                    pass  # JSON of another shape: nothing to capture
                except msgspec.DecodeError:
                    self.bad = self.bad or data  # passed on as it came; `check` raises
        self._capture.chunks(chunks)

    def check(self, *, at_end: bool, sample: bytes = b"") -> None:
        """Raise MalformedAnswer for a stream unlike the API's: an event that is not JSON, or
        (`at_end`: D closed it) an end without the terminator (`[DONE]`; a Responses stream's
        last event) and without an error event of D's own."""
        self._capture_pending()
        cap = self._capture
        if at_end and not (self._done or cap.terminal or cap.cap.error is not None):
            raise MalformedAnswer("the stream ended without its terminator", sample)
        if self.bad:
            raise MalformedAnswer("an event that is not JSON", self.bad)

    def _end_of_event(self, data: bytes | bytearray, start: int) -> tuple[int, int]:
        """(index of the blank line that ends the event at `start`, its length) or (-1, 0)."""
        first, second = self._first, self._second
        i = data.find(first, start)
        j = data.find(second, start, len(data) if i < 0 else i + len(second) - 1)
        if j < 0:
            return i, len(first)
        self._first, self._second = second, first
        return j, len(second)

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward now: every complete event, rewritten only where needed."""
        if not self._held:
            line, _, rest = data.partition(b"\n")
            if rest == b"\n":  # one one-line event: every read of a paced D
                one = self._one_event(data, line)
                if one is not None:
                    return one
            # `find`, not `in`: bytes.__contains__ tries its argument as an int first, and
            # raises and clears a TypeError for every bytes one.
            elif data.endswith(_LF) and data.find(b"\r") < 0:
                fast = self._whole_events(data)
                if fast is not None:
                    return fast
            return self._events(data)
        held = self._held
        held += data
        if self._end_of_event(held, self._scan_from)[0] < 0:
            self._scan_from = max(0, len(held) - 3)
            return b""
        self._held = bytearray()
        return self._events(bytes(held))

    def _events(self, data: bytes) -> bytes:
        """Event by event: the complete ones forwarded (rewritten where needed), the rest
        held."""
        self._scan_from = 0
        out: list[bytes] = []
        emitted = start = 0
        while True:
            end, sep = self._end_of_event(data, start)
            if end < 0:
                break
            new = self._event(data[start:end], data[end : end + sep])
            if new is not None:
                out.append(data[emitted:start])
                out.append(new)
                emitted = end + sep
            start = end + sep
        if start < len(data):
            self._held = bytearray(data[start:])
            self._scan_from = max(0, len(self._held) - 3)
        if not out:
            return data if start == len(data) else data[:start]
        out.append(data[emitted:start])
        return b"".join(out)

    def flush(self) -> bytes:
        """At EOF: what is held, as a last event (still captured and stripped)."""
        if not self._held:
            return b""
        rest, self._held = bytes(self._held), bytearray()
        new = self._event(rest, b"")
        return rest if new is None else new

    def _one_event(self, data: bytes, line: bytes) -> bytes | None:
        """A read of one one-line event (`line`, and `data` with its blank line): the bytes
        to forward, token ids cut; None for a handle to strip, ids written otherwise, or not
        a data line (then the general path). The event's data is only kept for the batched
        capture.

        Measured, this work is the whole of the router's CPU per paced chunk above the
        floor's, so it searches with `partition`: it takes its one argument as it is, where
        find, count and startswith parse theirs (PyArg_ParseTuple, ~500 instructions a call
        under callgrind) and a regex search tries a match at every `,"` of the chunk."""
        body = line.removeprefix(b"data: ")  # the line itself when it is no data line
        if body is line or line.partition(b"\r")[1]:  # a CR ends a line too (SSE)
            return None
        if body == b"[DONE]":
            self._done = True
            return data
        _, kv, after = body.partition(KV_KEY)
        if kv and (after[:5] != b":null" or after.partition(KV_KEY)[1]):
            return None  # a handle to strip (the null key of vLLM 0.33 passes)
        if self._strip_raw and body.partition(RAW_MESSAGES)[1]:
            return None
        out = cut_ids(data) if self._strip_ids else data
        if out is None:
            return None
        self._pending.append(body)
        if len(self._pending) >= CAPTURE_BATCH:
            self._capture_pending()
        return out

    def _whole_events(self, data: bytes) -> bytes | None:
        """A read of several whole one-line `data: ...` events (a D faster than its reader):
        the bytes to forward, with no handle among them and token ids cut from the whole read
        at once; None for anything else (then event by event). Each event's data is only
        kept for the batched capture."""
        events = data[:-2].split(_LF)
        for event in events:
            if not event.startswith(b"data: ") or event.find(b"\n") >= 0:
                return None
        if data.count(KV_KEY) != data.count(NULL_KV):  # a handle to strip: event by event
            return None
        if self._strip_raw and data.find(RAW_MESSAGES) >= 0:
            return None
        out = cut_every_id(data) if self._strip_ids else data
        if out is None:  # ids spelled otherwise: decoded event by event
            return None
        for event in events:
            if event == b"data: [DONE]":
                self._done = True
            else:
                self._pending.append(event[6:])
        if len(self._pending) >= CAPTURE_BATCH:
            self._capture_pending()
        return out

    def _event(self, block: bytes, sep: bytes) -> bytes | None:
        """Capture one event; its replacement bytes, or None to forward it unchanged."""
        data = _data_of(block)
        if data is None:
            return None
        keep = self._capture_data(data)
        if keep is not None:
            return None if keep else self._rewrite(block, data, sep)
        return self._cut(block, data, sep)

    def _capture_data(self, data: bytes) -> bool | None:
        """Capture one event's data. True: forward it unchanged; False: it has a handle to
        strip (decode and re-encode); None: only token ids to cut."""
        if data == b"[DONE]":
            self._done = True
            return True
        self._pending.append(data)
        if len(self._pending) >= CAPTURE_BATCH:
            self._capture_pending()
        # A handle to strip, or (Responses) token ids in input_messages/output_messages: a
        # decode and re-encode.
        if strippable_kv(data) or (self._strip_raw and RAW_MESSAGES in data):
            return False
        return None if self._strip_ids and TOKEN_IDS_KEY in data else True

    def _cut(self, block: bytes, data: bytes, sep: bytes) -> bytes | None:
        """The event without its token-id members (cut out of the bytes where they are
        written as vLLM writes them, else by `_rewrite`)."""
        cut = cut_ids(data)
        if cut is not None:
            return _with_data(block, cut, b"\r\n" if sep == _CRLF else b"\n") + sep
        return self._rewrite(block, data, sep)

    def _rewrite(self, block: bytes, data: bytes, sep: bytes) -> bytes | None:
        """The event with our fields removed by a decode and re-encode (None: nothing to, or
        not JSON: the client gets it as sent)."""
        try:
            obj = _decode_any(data)
        except msgspec.DecodeError:
            return None
        if not isinstance(obj, dict) or not strip_fields(obj, self._strip_ids):
            return None
        eol = b"\r\n" if sep == _CRLF else b"\n"
        return _with_data(block, _encode(obj), eol) + sep


def capture_body(body: bytes, *, strip_token_ids: bool) -> tuple[bytes, Captured]:
    """A non-streaming D body: what it tells the router, and the body for the client.

    Only our fields are removed (top-level kv_transfer_params, and token ids when the
    client did not ask for them); usage and everything else stay as D sent them. A body that
    is not the object the API promises (choices, a Responses object, or an error) raises
    MalformedAnswer, whatever its content type said.
    """
    capture = Capture()
    try:
        obj = _decode_any(body)
    except msgspec.DecodeError:
        raise MalformedAnswer("a body that is not JSON", body) from None
    if not isinstance(obj, dict) or not (
        isinstance(obj.get("choices"), list)
        or obj.get("object") == "response"
        or isinstance(obj.get("error"), dict)
    ):
        raise MalformedAnswer("JSON that is not a response object", body)
    with contextlib.suppress(msgspec.ValidationError):
        capture.chunk(msgspec.convert(obj, Chunk))
        if obj.get("object") == "response":  # a Responses API body
            capture.response(msgspec.convert(obj, Response))
            responses_output(capture, obj.get("output"))
    body = _encode(obj) if strip_fields(obj, strip_token_ids) else body
    capture.cap.response = body if obj.get("object") == "response" else None
    return body, capture.result()
