"""The Redis server's history as the store sees it: each new connection reads the server's run
id, and another one than the routers recorded (a restart from an RDB or AOF, a restore, a
promoted replica) means the records may be older than what the routers did since (issue 48)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError

from sessions import scripts
from sessions.keys import STORE_RUN_KEY

log = logging.getLogger("kvbaton.store")


def run_id(info: bytes | str) -> str:
    """The `run_id` of an `INFO server` reply ("" without one)."""
    text = info.decode("utf-8", "replace") if isinstance(info, bytes) else info
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line[len("run_id:") :].strip()
    return ""


class RunWatch:
    """`since`: wall-clock time since when the server's run id is the one the routers recorded
    (`STORE_RUN_KEY`): a handle committed before it is not read. 0 while nothing is known
    against any (a first server, or one that came back empty)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.since = 0.0
        self._unknown = ""  # why the run id cannot be read (logged once)

    async def connected(self, conn: Connection) -> None:
        """redis-py's `redis_connect_func`: the connection's own set-up, then the run id."""
        await conn.on_connect()
        try:
            await conn.send_command("INFO", "server")
            current = run_id(await conn.read_response())
            if not current:
                raise ResponseError("INFO server has no run_id")
            await conn.send_command(
                "EVAL", scripts.STORE_RUN, 1, STORE_RUN_KEY, current, repr(self._clock())
            )
            reply = await conn.read_response()
            since = float(reply.decode() if isinstance(reply, bytes) else reply)
        except (ResponseError, ValueError) as exc:  # an ACL refused INFO or EVAL
            self._cannot_follow(str(exc) or type(exc).__name__)
            return
        if since > self.since:
            log.warning(
                "the session store's server changed (run id %s: restarted, restored or failed "
                "over): handles committed before are not read",
                current,
            )
            self.since = since

    def _cannot_follow(self, why: str) -> None:
        if not self._unknown:
            self._unknown = why
            log.warning(
                "the session store's history cannot be followed (%s): a restart, restore or "
                "failover of Redis is not seen, and a record it brings back could name a "
                "handle already read",
                why,
            )
