"""The redis.asyncio client a Redis URL names: one server, a Redis Cluster, or a Sentinel master.

    redis://[user:pass@]host:port[/db]      one server (also rediss:// and unix://)
    redis+cluster://[user:pass@]host:port[,host:port...]        Redis Cluster (rediss+cluster://)
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]   (rediss+sentinel://)

Cluster and Sentinel URLs list seed nodes (a port defaults to 6379, or 26379 for a sentinel);
the client finds the rest. Every key kvbaton writes carries a `{...}` hash tag and every script
touches one key, so the same scripts run on a cluster.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError

RedisClient = aioredis.Redis | RedisCluster

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
# Connections per server (per node on a cluster): more than one router process has turns in
# flight, and far below Redis's default maxclients (10000).
MAX_CONNECTIONS = 1024


class BoundedPool(aioredis.ConnectionPool):
    """redis-py's pool with `max_connections` as a bound a command waits at (up to `timeout`
    seconds, then ConnectionError "No connection available."), as BlockingConnectionPool does,
    but through a semaphore: taking a free slot costs no condition, lock or timer, where
    BlockingConnectionPool's took 2.3x redis-py's plain get_connection (cProfile, a hit turn's
    two calls). Connections are made on demand and kept, as in redis-py's pool.

    A slot is held by a connection handed out (`_holding`), so that it is freed once whatever
    path gives the connection back: redis-py's get_connection itself releases a connection it
    made but could not connect, before the caller ever sees it.
    """

    def __init__(
        self, *, max_connections: int = MAX_CONNECTIONS, timeout: float | None = None, **kw: Any
    ) -> None:
        # The pool's own ceiling sits above the bound: a connection whose release redis-py
        # finishes in the background (its release cancelled) is still counted in use there
        # after its slot is free again.
        super().__init__(max_connections=2 * max_connections, **kw)
        self.bound = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        self._holding: set[Any] = set()
        self._wait = timeout

    async def get_connection(self, *args: Any, **kw: Any) -> Any:
        slots = self._slots
        if slots.locked():  # every slot taken: wait for one, up to the timeout
            try:
                async with asyncio.timeout(self._wait):
                    await slots.acquire()
            except TimeoutError:
                raise RedisConnectionError("No connection available.") from None
        else:
            await slots.acquire()  # a free slot: taken without suspending
        try:
            connection = await super().get_connection(*args, **kw)  # type: ignore[no-untyped-call]
        except BaseException:
            slots.release()
            raise
        self._holding.add(connection)
        return connection

    async def release(self, connection: Any) -> None:
        if connection not in self._holding:  # not handed out (or released already)
            await super().release(connection)
            return
        self._holding.discard(connection)
        try:
            await super().release(connection)
        finally:
            self._slots.release()

    async def take(self) -> Any:
        """A connection for one command of sessions.evaluate: an idle one with a free slot is
        taken as it is, without the pool's lock, its observability hooks or its check that
        nothing is left to read (redis-py drops a connection whose reply was not read, and
        the command reconnects one that is not connected); otherwise get_connection."""
        if self._slots.locked() or not self._available_connections:
            return await self.get_connection()
        await self._slots.acquire()  # a free slot: taken without suspending
        connection = self._available_connections.pop()
        self._in_use_connections.add(connection)
        self._holding.add(connection)
        return connection

    def give(self, connection: Any) -> None:
        """A connection from take() back to the pool (disconnected or not)."""
        self._holding.remove(connection)
        self._in_use_connections.discard(connection)
        self._available_connections.append(connection)
        self._slots.release()


@dataclass(frozen=True)
class Target:
    """A parsed cluster or sentinel URL."""

    kind: str  # "cluster" | "sentinel"
    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = None
    service: str = ""  # sentinel: the monitored master's name
    db: int = 0
    options: dict[str, Any] = field(default_factory=dict)


def _node(text: str, default_port: int, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"{url}: empty host in {text!r}")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise ValueError(f"{url}: bad port in {text!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{url}: port out of range in {text!r}")
    return host, port


def _db(text: str, url: str) -> int:
    try:
        return int(text) if text else 0
    except ValueError:
        raise ValueError(f"{url}: the database must be a number, not {text!r}") from None


def parse(url: str) -> Target | None:
    """A cluster or sentinel URL parsed; None for a plain redis://, rediss:// or unix:// URL."""
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        return None
    kind = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = tuple(_node(h, _DEFAULT_PORT[kind], url) for h in hosts.split(",") if h)
    if not nodes:
        raise ValueError(f"{url}: no {kind} node given")
    parts = [p for p in path.split("/") if p]
    service, db = "", 0
    if kind == "sentinel":
        if not parts or len(parts) > 2:
            raise ValueError(f"{url}: expected /<service_name>[/<db>] after the sentinels")
        service = unquote(parts[0])
        db = _db(parts[1] if len(parts) == 2 else "", url)
    else:
        if len(parts) > 1:
            raise ValueError(f"{url}: a cluster URL takes no path but an optional /0")
        db = _db(parts[0] if parts else "", url)
        if db != 0:
            raise ValueError(f"{url}: Redis Cluster has database 0 only")
    tls = scheme.startswith("rediss")
    return Target(kind, nodes, tls, username, password, service, db)


def connect(
    url: str,
    *,
    socket_timeout: float | None = None,
    connect_timeout: float | None = None,
    retry: Retry | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> RedisClient:
    """A client for url (nothing is connected until the first command).

    redis-py's default pool fails a command at once ("Too many connections") past 100
    connections, which under load would open the router's store circuit for every turn. A
    single server gets a blocking pool instead (a command waits up to connect_timeout for a
    free connection, BoundedPool); cluster nodes and a Sentinel master get max_connections each.
    """
    target = parse(url)
    if target is None:
        pool = BoundedPool.from_url(
            url,
            max_connections=max_connections,
            timeout=connect_timeout,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=retry,
        )
        return aioredis.Redis.from_pool(pool)
    if target.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            ssl=target.tls,
            username=target.username,
            password=target.password,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=retry,
            max_connections=max_connections,
        )
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
        list(target.nodes),
        # The credentials in the URL are the master's; sentinels are asked without them.
        sentinel_kwargs={
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "max_connections": max_connections,  # every new master connection asks them
        },
    )
    master: aioredis.Redis = sentinel.master_for(
        target.service,
        db=target.db,
        ssl=target.tls,
        username=target.username,
        password=target.password,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=retry,
        max_connections=max_connections,
    )
    return master


async def close(client: RedisClient) -> None:
    """Close the client's connections, and a Sentinel master's connections to its sentinels."""
    pool = client.connection_pool if isinstance(client, aioredis.Redis) else None
    await client.aclose()
    if isinstance(pool, SentinelConnectionPool):
        for sentinel in pool.sentinel_manager.sentinels:
            await sentinel.aclose()
