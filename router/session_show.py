"""`kvbaton session show ID`: a conversation found from what an operator knows (its id and
the client's API key, or its --tenant-header value): its Redis key, its tenant hash, the name
the router's log lines give it, and its state read from Redis, decoded, with whether its
signature verifies (the secret from KVBATON_SESSION_SECRET) and when its handle expires."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec

from router.errors import BadRequest
from router.lifecycle.advice import masked
from router.turn.tenant import conversation_hash, tenant_of, validate_conversation_id
from sessions import integrity
from sessions.admin_ops import read_conversation
from sessions.codec import StateDecodeError, from_fields
from sessions.keys import conversation_key
from sessions.model import SessionState
from sessions.store import StoreError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # the router's default --redis-url
TIMEOUT_S = 5.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvbaton session",
        description="Look up a conversation's session in Redis, as the router stores it.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="show")
    show = commands.add_parser(
        "show",
        help="a conversation's key, tenant, log name and decoded state",
        description="Print a conversation's Redis key, its tenant hash, the `conv=` name its "
        "turn log lines carry, and its state decoded (the signature checked with "
        "KVBATON_SESSION_SECRET when set). Exit status 1 when there is no such session.",
    )
    show.add_argument("conversation_id", metavar="ID", help="the conversation id the client sent")
    who = show.add_mutually_exclusive_group()
    who.add_argument(
        "--api-key", metavar="KEY", help="the client's API key (its bearer token; none: default)"
    )
    who.add_argument(
        "--tenant-header-value",
        metavar="VALUE",
        help="the value of the router's --tenant-header the client sent",
    )
    who.add_argument("--tenant", metavar="HASH", help="the tenant hash itself (or 'default')")
    show.add_argument(
        "--redis-url",
        metavar="URL",
        default=os.environ.get("KVBATON_REDIS_URL") or DEFAULT_REDIS_URL,
        help="the router's --redis-url (default: $KVBATON_REDIS_URL, else %(default)s)",
    )
    show.add_argument("--json", action="store_true", help="one JSON object instead of text")
    return parser.parse_args(list(argv))


def tenant_for(args: argparse.Namespace) -> tuple[str, str]:
    """The tenant hash, and where it came from."""
    if args.tenant:
        return args.tenant, "given with --tenant"
    if args.tenant_header_value:
        return tenant_of(None, args.tenant_header_value), "the --tenant-header value's hash"
    if args.api_key:
        return tenant_of(f"Bearer {args.api_key}"), "the API key's hash"
    return tenant_of(None), "no API key: the tenant of requests without credentials"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def signature(key: str, state: SessionState) -> str:
    if not state.mac:
        return "unsigned (the router runs with --unsigned-sessions)"
    secrets = tuple(s.strip() for s in os.environ.get("KVBATON_SESSION_SECRET", "").split(","))
    secrets = tuple(s for s in secrets if s)
    if not secrets:
        return "not checked (set KVBATON_SESSION_SECRET to the router's secret)"
    if integrity.authentic(secrets, key, state):
        return "verified"
    return "FAILS: the router reads this session as a miss (handle-unauthenticated)"


def handle(state: SessionState, now: float) -> dict[str, Any]:
    present = state.kv_transfer_params is not None
    out: dict[str, Any] = {"present": present, "tokens": state.token_count}
    if state.inflight:
        out["claimed_by"] = state.inflight
    if present and state.handle_expires_at:
        out["expires_at"] = _iso(state.handle_expires_at)
        out["expires_in_s"] = round(state.handle_expires_at - now, 1)
    if not present:
        out["no_handle_reason"] = state.no_handle_reason
    return out


def handle_line(h: dict[str, Any]) -> str:
    if h.get("claimed_by"):
        return f"held by the turn in flight {h['claimed_by']}"
    if not h["present"]:
        return f"none ({h['no_handle_reason'] or 'no reason stored'})"
    left = h.get("expires_in_s")
    if left is None:
        return f"live, {h['tokens']} tokens of KV on D"
    when = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
    return f"live, {h['tokens']} tokens of KV on D, {when} ({h['expires_at']})"


def report(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """What `show` prints (as a dict) and its exit status."""
    tenant, origin = tenant_for(args)
    key = conversation_key(tenant, args.conversation_id)
    out: dict[str, Any] = {
        "conversation_id": args.conversation_id,
        "tenant": tenant,
        "tenant_from": origin,
        "key": key,
        "log_name": conversation_hash(key),
        "admin": f"/admin/conversations/{args.conversation_id}?tenant={tenant}",
    }
    fields, ttl = asyncio.run(read_conversation(args.redis_url, key, TIMEOUT_S))
    out["exists"] = bool(fields)
    if not fields:
        return out, 1
    out["ttl_s"] = ttl
    try:
        state = from_fields(fields)
    except StateDecodeError as exc:
        out["error"] = f"not a session state: {exc}"
        return out, 1
    out["signature"] = signature(key, state)
    out["handle"] = handle(state, time.time())
    out["state"] = msgspec.to_builtins(state)
    return out, 0


def print_text(out: dict[str, Any]) -> None:
    print(f"key        {out['key']}")
    print(f"tenant     {out['tenant']}  ({out['tenant_from']})")
    print(f"log name   conv={out['log_name']}  (the turn lines' conv field)")
    print(f"admin API  GET {out['admin']}")
    if not out["exists"]:
        print(f"no session stored under {out['key']} (never, expired, or another tenant)")
        return
    if "error" in out:
        print(out["error"])
        return
    ttl = out["ttl_s"]
    print(f"ttl        {'none' if ttl < 0 else f'{ttl:.0f} s'}")
    print(f"signature  {out['signature']}")
    print(f"handle     {handle_line(out['handle'])}")
    print("state")
    for name, value in out["state"].items():
        text = msgspec.json.encode(value).decode() if isinstance(value, dict | list) else value
        if name in ("created_at", "updated_at", "handle_expires_at", "decode_started") and value:
            text = f"{value}  ({_iso(value)})"
        print(f"  {name:<18} {text}")


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        validate_conversation_id(args.conversation_id)
        out, status = report(args)
    except BadRequest as exc:
        print(f"kvbaton session show: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:
        where = masked(args.redis_url)
        print(f"kvbaton session show: Redis at {where} (--redis-url): {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(msgspec.json.encode(out).decode())
    else:
        print_text(out)
    return status
