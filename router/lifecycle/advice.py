"""Misconfiguration said once, at start, with the fix: the session store's address (password
masked) and the flag that sets it; an engine URL given with a `/v1` suffix."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

from router.config import Settings
from router.flag import cli_name, env_name
from sessions.guard import StoreGuard

log = logging.getLogger("kvbaton.discovery")


def masked(url: str) -> str:
    """The URL with its password, if any, as `***` (it goes to logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def store_guard(settings: Settings) -> StoreGuard:
    """The store breaker, naming the store as its logs should: Redis by its URL and flag."""
    guard = StoreGuard(settings.store_retry_after)
    if settings.session_store == "redis":
        guard.name = f"Redis at {masked(settings.redis_url)}"
        guard.hint = (
            f"check {cli_name('redis_url')} / {env_name('redis_url')}, or run one replica "
            f"without Redis with {cli_name('session_store')} memory"
        )
    return guard


def v1_hint(url: str) -> str:
    """The fix for an engine URL ending in /v1 (the router adds /v1/... itself), or ""."""
    if not url.rstrip("/").endswith("/v1"):
        return ""
    return f"drop the /v1 suffix: the engine's base URL is {url.rstrip('/')[: -len('/v1')]}"


def warn_v1_suffixes(settings: Settings) -> None:
    """One line per --prefill/--decode URL that ends in /v1, naming the URL to give."""
    for role in ("prefill", "decode"):
        for url in getattr(settings, role):
            hint = v1_hint(url)
            if hint:
                log.warning("%s %s: %s", cli_name(role), url, hint)
