"""Request bodies that cannot be read (issue 32, item 3): a malformed chunked encoding gets an
OpenAI-format 400 with the turn's X-Request-Id, one log line and no traceback; a client that
hangs up in the middle of its body costs one line too. Raw sockets, the real router."""

from __future__ import annotations

import json
import socket
import time

import pytest

from harness.procs import wait_until
from tests.reliability.conftest import Stack
from tests.reliability.helpers import read_to_close, request_head, total

BAD_CHUNKS = {
    "size-ZZ": b"ZZ\r\n{}\r\n0\r\n\r\n",
    "size-negative": b"-5\r\n{}\r\n0\r\n\r\n",
    "no-crlf-after-data": b"2\r\n{}XX0\r\n\r\n",
}


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    return int(status_line.split()[1]), headers, body


def written_since(stack: Stack, offset: int) -> list[str]:
    with stack.router.log.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace").splitlines()


def lines_for(stack: Stack, offset: int, want: str) -> list[str]:
    """The router's lines since `offset` once one holds `want` and the log stopped growing,
    less the health loop's (an instance an earlier test failed, re-admitted meanwhile)."""
    wait_until(lambda: any(want in line for line in written_since(stack, offset)), want, 10)
    settle_log(stack)
    return [line for line in written_since(stack, offset) if "kvbaton.backends" not in line]


def settle_log(stack: Stack) -> int:
    """The router log's size once it stopped growing (the last test's lines are out)."""
    size = -1
    while size != stack.router.log.stat().st_size:
        size = stack.router.log.stat().st_size
        time.sleep(0.2)
    return size


@pytest.mark.parametrize("framing", list(BAD_CHUNKS), ids=list(BAD_CHUNKS))
def test_a_malformed_chunked_body_is_a_one_line_openai_400(stack: Stack, framing: str) -> None:
    port = stack.router.port
    offset = settle_log(stack)
    before = total([*stack.ps, *stack.ds], "vllm:prompt_tokens_total")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_head(port, {"Transfer-Encoding": "chunked"}))
        time.sleep(0.2)  # the head alone first: the turn has begun when the bad chunk comes
        sock.sendall(BAD_CHUNKS[framing])
        data = read_to_close(sock, 5.0)
    status, headers, body = split_response(data)
    assert status == 400, data[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert "code" in error
    request_id = headers.get("x-request-id")
    assert request_id, headers
    assert total([*stack.ps, *stack.ds], "vllm:prompt_tokens_total") == before
    lines = lines_for(stack, offset, request_id)
    assert not any("Traceback" in line for line in lines), lines
    ours = [line for line in lines if request_id in line]
    assert len(ours) == 1, lines
    assert len(lines) == 1, lines
    assert "could not be parsed" in ours[0]


def test_a_client_that_hangs_up_mid_body_costs_one_line(stack: Stack) -> None:
    port = stack.router.port
    offset = settle_log(stack)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_head(port, {"Content-Length": "1000"}))
        sock.sendall(b'{"model": ')
        time.sleep(0.3)
    lines = lines_for(stack, offset, "closed the connection")
    assert not any("Traceback" in line for line in lines), lines
    assert len(lines) == 1 and "closed the connection" in lines[0], lines
