"""RelayResponse: the start through the app's middleware, the body with the server's own send,
and a client that hangs up mid-stream cancels the relay (whose cleanup runs) quietly."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Send

from router.relay import SERVER_SEND, RelayResponse


class Sink:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: Any) -> None:
        self.messages.append(message)


def _relay(chunks: list[bytes], cleaned: list[str]) -> Any:
    async def relay(send: Send) -> None:
        try:
            for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await asyncio.sleep(0)
        finally:
            cleaned.append("relay cleaned up")

    return relay


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


async def test_the_start_goes_through_the_app_and_the_body_to_the_server() -> None:
    app_send, server_send, cleaned = Sink(), Sink(), []
    relay = _relay([b"data: 1\n\n", b"data: 2\n\n"], cleaned)
    response = RelayResponse(relay, {"X-Request-Id": "r"}, "text/event-stream")
    await response({"type": "http", SERVER_SEND: server_send}, _never_disconnects, app_send)
    assert [m["type"] for m in app_send.messages] == ["http.response.start"]
    assert (b"x-request-id", b"r") in app_send.messages[0]["headers"]
    assert [(m["body"], m["more_body"]) for m in server_send.messages] == [
        (b"data: 1\n\n", True),
        (b"data: 2\n\n", True),
        (b"", False),
    ]
    assert cleaned == ["relay cleaned up"]


async def test_without_the_servers_send_everything_goes_through_the_app() -> None:
    app_send, cleaned = Sink(), []
    response = RelayResponse(_relay([b"data: 1\n\n"], cleaned), {}, "text/event-stream")
    await response({"type": "http"}, _never_disconnects, app_send)
    assert [m["type"] for m in app_send.messages] == ["http.response.start"] + [
        "http.response.body"
    ] * 2


async def test_a_client_that_hangs_up_cancels_the_relay_quietly() -> None:
    sent, cleaned = Sink(), []
    started = asyncio.Event()

    async def endless(send: Send) -> None:
        try:
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            started.set()
            await asyncio.Event().wait()  # D is silent; the client leaves meanwhile
        finally:
            cleaned.append("relay cleaned up")

    async def receive() -> dict[str, Any]:
        await started.wait()
        return {"type": "http.disconnect"}

    response = RelayResponse(endless, {}, "text/event-stream")
    await asyncio.wait_for(response({"type": "http", SERVER_SEND: sent}, receive, sent), 5)
    assert cleaned == ["relay cleaned up"]
    assert not any(m.get("more_body") is False for m in sent.messages)  # no clean end sent
    task = asyncio.current_task()
    assert task is not None and not task.cancelling()  # the watch's cancel was taken back
