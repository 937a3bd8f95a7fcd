"""vLLM 0.33's pause and sleep routes (vllm_sim/pause.py has what they change)."""

from __future__ import annotations

from aiohttp import web

from vllm_sim.dp import Ranks
from vllm_sim.errors import ApiError
from vllm_sim.serving import json_response


class PauseRoutes:
    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise ApiError(f"mode must be abort, wait or keep, not {mode!r}", param="mode")
        self.ranks.pause.pause(mode)
        return json_response({"status": "paused"})

    async def resume(self, _: web.Request) -> web.Response:
        self.ranks.pause.resume()
        return json_response({"status": "resumed"})

    async def is_paused(self, _: web.Request) -> web.Response:
        return json_response({"is_paused": self.ranks.pause.paused})

    async def sleep(self, request: web.Request) -> web.Response:
        """Level 1+ discards the KV cache. In-flight requests finish first (vLLM's mode
        "wait"; the simulator does not abort them)."""
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            level = -1
        if not 0 <= level <= 2:
            raise ApiError("level must be 0, 1 or 2", param="level")
        self.ranks.pause.sleep(level)
        for engine in self.ranks.engines:
            while engine.running:
                engine.idle.clear()
                await engine.idle.wait()
        if level >= 1:
            for engine in self.ranks.engines:
                engine.sleep()
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(self, _: web.Request) -> web.Response:
        if self.ranks.pause.sleep_level >= 1:
            for engine in self.ranks.engines:
                engine.wake_up()
        self.ranks.pause.wake_up()
        return json_response({"status": "awake", "tags": None})

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return json_response({"is_sleeping": self.ranks.pause.sleeping})


def add_routes(app: web.Application, ranks: Ranks) -> None:
    routes = PauseRoutes(ranks)
    r = app.router
    r.add_post("/pause", routes.pause)
    r.add_post("/resume", routes.resume)
    r.add_get("/is_paused", routes.is_paused)
    r.add_post("/sleep", routes.sleep)
    r.add_post("/wake_up", routes.wake_up)
    r.add_get("/is_sleeping", routes.is_sleeping)
