"""--resolve-dns against a real router (Hypercorn, in this process so the test owns the
resolver) and simulator engines: a decode name that resolves to two addresses is two
instances in /status; an address that leaves DNS is drained out of the pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config

from harness.procs import SimProc, free_port, sims
from harness.waiting import scaled
from router.config import load_settings
from router.http.app import create_app

pytestmark = pytest.mark.e2e

NAME = "decode.kvbaton.test"  # .test never resolves for real: only the resolver below answers


class Zone:
    """The DNS the test controls. A headless Service answers one port for every address;
    here the engines share 127.0.0.1, so each answer carries its own port (as getaddrinfo's
    sockaddr does)."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int]]] = {}

    async def resolve(self, host: str, port: int) -> list[tuple[str, int]]:
        if host not in self.records:
            raise OSError(f"{host}: name does not resolve")
        return list(self.records[host])


@pytest.fixture(scope="module")
def engines() -> Iterator[list[SimProc]]:
    slow = ("decode", "--decode-ms-per-token", "40")  # a turn stays in flight for seconds
    with sims(("prefill",), ("decode",), ("decode",), slow, name="dns") as procs:
        yield procs


@contextlib.asynccontextmanager
async def serving(zone: Zone, prefill: str) -> AsyncIterator[str]:
    port = free_port()
    argv = ["--prefill", prefill, "--decode", f"http://{NAME}:8200", "--resolve-dns"]
    argv += ["--session-store", "memory", "--health-interval", "0.2", "--port", str(port)]
    settings = load_settings(argv, env={})
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(create_app(settings, resolver=zone), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.05)
        yield url
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def get_status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url + "/status") as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


async def decodes_become(url: str, want: list[str], timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + scaled(timeout)
    while True:
        body = await get_status(url)
        if sorted(body["decode_nodes"]) == sorted(want):
            return body
        assert time.monotonic() < deadline, f"decode nodes {body['decode_nodes']}, want {want}"
        await asyncio.sleep(0.1)


async def test_a_name_with_two_addresses_is_two_instances_and_a_vanished_one_leaves(
    engines: list[SimProc],
) -> None:
    p, d1, d2, _ = engines
    zone = Zone()
    zone.records[NAME] = [("127.0.0.1", d1.port), ("127.0.0.1", d2.port)]
    async with serving(zone, p.url) as url:
        body = await decodes_become(url, [d1.url, d2.url])
        assert body["decode_node_count"] == 2 and body["prefill_node_count"] == 1
        assert body["prefill_nodes"] == [p.url]
        for inst in body["instances"]["decode"]:
            assert inst["source"] == "dns" and inst["healthy"] and inst["model"] == "sim-model"
        async with aiohttp.ClientSession() as http:
            chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200
            async with http.get(url + "/ready") as resp:
                assert resp.status == 200

        zone.records[NAME] = [("127.0.0.1", d1.port)]  # d2's pod went away
        body = await decodes_become(url, [d1.url])
        assert body["decode_node_count"] == 1

        del zone.records[NAME]  # a DNS failure keeps what is known
        await asyncio.sleep(0.6)
        assert (await get_status(url))["decode_nodes"] == [d1.url]

        zone.records[NAME] = [("127.0.0.1", d2.port), ("127.0.0.1", d1.port)]  # scaled up
        await decodes_become(url, [d1.url, d2.url])


async def stream_turn(url: str) -> int:
    """A streamed 60-token turn read to the end; returns its status."""
    body = {
        "model": "sim-model",
        "stream": True,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        await resp.read()
        return resp.status


async def test_an_address_that_leaves_with_a_turn_on_it_drains_until_the_turn_ends(
    engines: list[SimProc],
) -> None:
    p, d1, _, slow = engines
    zone = Zone()
    zone.records[NAME] = [("127.0.0.1", slow.port)]
    async with serving(zone, p.url) as url:
        await decodes_become(url, [slow.url])
        turn = asyncio.create_task(stream_turn(url))
        deadline = time.monotonic() + 10
        while not [i for i in (await get_status(url))["instances"]["decode"] if i["outstanding"]]:
            assert time.monotonic() < deadline, "the turn never reached the slow decode"
            await asyncio.sleep(0.05)
        zone.records[NAME] = [("127.0.0.1", d1.port)]  # the slow pod is replaced
        body = await decodes_become(url, [d1.url, slow.url])
        (gone,) = [i for i in body["instances"]["decode"] if i["url"] == slow.url]
        assert gone["draining"] and gone["outstanding"] == 1 and not gone["usable"]
        assert await turn == 200  # the turn in flight finished on it
        await decodes_become(url, [d1.url])
