"""Engine discovery by DNS (`--resolve-dns`): a configured instance whose host name resolves to
several addresses (a Kubernetes headless Service) is one instance per address, re-resolved by
the registry's Syncer every `health_interval`."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

log = logging.getLogger("kvbaton.dns")

RESOLVE_TIMEOUT = 5.0


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[tuple[str, int]]:
        """The (address, port) pairs `host` resolves to (getaddrinfo's sockaddr); raises
        OSError when the name does not resolve."""
        ...


class SystemResolver:
    """The process's own resolver (getaddrinfo in a thread: /etc/hosts, cluster DNS)."""

    async def resolve(self, host: str, port: int) -> list[tuple[str, int]]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({(str(info[4][0]), int(info[4][1])) for info in infos})


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def address_url(scheme: str, address: str, port: int, path: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}{path.rstrip('/')}"


@dataclass
class DnsExpander:
    """Turns base URLs into per-address URLs. A name that fails to resolve (or resolves to
    nothing) keeps its last known addresses, so a DNS hiccup never drains a whole role; a
    name never resolved stays as it is (the HTTP client resolves it per connection)."""

    resolver: Resolver
    timeout: float = RESOLVE_TIMEOUT
    last: dict[str, tuple[str, ...]] = field(default_factory=dict)
    _failing: set[str] = field(default_factory=set)

    @property
    def expanded(self) -> set[str]:
        """Every per-address URL the names resolve to now."""
        return {url for urls in self.last.values() for url in urls}

    async def expand(self, urls: Iterable[str]) -> tuple[str, ...]:
        out: list[str] = []
        for url in urls:
            out.extend(await self._one(url))
        return tuple(dict.fromkeys(out))

    async def _one(self, url: str) -> tuple[str, ...]:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if not host or _is_address(host):
            return (url,)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            found = await asyncio.wait_for(self.resolver.resolve(host, port), self.timeout)
            if not found:
                raise OSError(f"{host} resolves to no address")
        except (OSError, TimeoutError) as exc:
            if url not in self._failing:
                self._failing.add(url)
                kept = len(self.last.get(url, ()))
                log.warning("cannot resolve %s (keeping %d known addresses): %s", url, kept, exc)
            return self.last.get(url, (url,))
        self._failing.discard(url)
        now = tuple(address_url(parts.scheme, a, p, parts.path) for a, p in sorted(set(found)))
        if self.last.get(url) != now:
            log.info("%s resolves to %s", url, ", ".join(now))
            self.last[url] = now
        return now
