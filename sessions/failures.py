"""A failed Redis call in words an operator can act on: what the router was doing, in user
terms, and why (a timeout names `--store-timeout`; an ACL or scripting refusal names the fix)."""

from __future__ import annotations

from redis.exceptions import NoPermissionError, NoScriptError, ResponseError

from sessions.store import StoreError, StoreRefused

DOING = {
    "claim": "reading a conversation's state for its turn",
    "take handle": "taking a conversation's handle to release it",
    "end": "ending a conversation",
    "spend": "marking a released handle spent",
    "delete": "deleting a conversation",
    "commit": "saving a conversation's next state",
    "release": "giving back a turn's claim on its conversation",
    "history lookup": "finding a conversation by its history",
    "history index": "indexing a conversation by its history",
    "note pin": "noting a handle in its D's pin index",
    "forget pin": "removing a handle from its D's pin index",
    "pins due": "listing the handles due for release",
    "pin totals": "reading what each D pins",
    "turn times": "reading the conversations' turn times",
    "get": "reading a conversation",
    "ping": "a ping (PING and a one-line script)",
    "response put": "storing a Responses API response",
    "response get": "reading a stored Responses API response",
    "response delete": "deleting a stored Responses API response",
}
# A server that answers but will not run what the router sends: an ACL without the scripting
# commands, a script it cannot load, commands renamed away.
# (redis-py raises NoPermissionError for NOPERM, NoScriptError for NOSCRIPT.)
REFUSED = (NoPermissionError, NoScriptError)
REFUSALS = ("NOPERM", "NOSCRIPT", "ERR unknown command")
FIX = (
    "the router's Redis user needs the scripting commands (ACL +@scripting) beside +@read "
    "+@write +@connection +info (docs/operations.md, The Redis user)"
)


def failure(what: str, exc: BaseException, timeout: float) -> StoreError:
    """The StoreError that says `what` failed, and why."""
    doing = DOING.get(what, what)
    refused = isinstance(exc, ResponseError) and str(exc).startswith(REFUSALS)
    if refused or isinstance(exc, REFUSED):
        return StoreRefused(f"the store refused {doing}: {exc}; {FIX}")
    if isinstance(exc, TimeoutError):
        return StoreError(f"{doing} timed out: no answer within {timeout:g} s (--store-timeout)")
    return StoreError(f"{doing} failed: {exc or type(exc).__name__}")
