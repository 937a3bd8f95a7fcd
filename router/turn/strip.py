"""What the router removes from D's answer before the client sees it: D's handle, and the
token ids the router asked for and the client did not. From a decoded object, or cut out of
an event's bytes where they are written as vLLM writes them (the relay's way: the rest of
the event passes as D's bytes).

Byte searches here use `partition` where they can: it takes its one argument as it is, where
find, count and startswith parse theirs (PyArg_ParseTuple, ~500 instructions a call under
callgrind) and `in` raises and clears a TypeError for every bytes argument.
"""

from __future__ import annotations

import re
from typing import Any

KV_KEY = b'"kv_transfer_params"'
TOKEN_IDS_KEY = b'token_ids"'  # matches "token_ids" and "prompt_token_ids"
# A Responses object's input_messages/output_messages with token ids (enable_response_messages).
RAW_MESSAGES = b'"raw_message_tokens"'
_MESSAGES = ("input_messages", "output_messages")
# vLLM 0.33 (PR #40186): every content chunk carries the key, null (compact JSON, as vLLM's
# serializer writes it).
NULL_KV = b'"kv_transfer_params":null'
# A token-id member as vLLM writes it (compact, after another member). In valid JSON `,"`
# never occurs inside a string, so a match is always a member; any other spelling is left
# to the relay's decode and re-encode.
_IDS_MEMBER = re.compile(rb',"(?:prompt_)?token_ids":(?:\[[0-9,]*\]|null)')
# A streamed chunk's own ids, as vLLM writes them (then the list's digits and `]`).
ONE_IDS = b',"token_ids":['


def strip_fields(obj: dict[str, Any], strip_token_ids: bool) -> bool:
    """Remove our fields from a freshly decoded (owned) object; True if anything changed."""
    changed = "kv_transfer_params" in obj
    obj.pop("kv_transfer_params", None)
    response = obj.get("response")
    if isinstance(response, dict) and "kv_transfer_params" in response:
        del response["kv_transfer_params"]
        changed = True
    if not strip_token_ids:
        return changed
    # A Responses body, or an event carrying one: null, as vLLM answers without the flag.
    changed = _null_messages(obj) | _null_messages(response) | changed
    if "prompt_token_ids" in obj:
        del obj["prompt_token_ids"]
        changed = True
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                for key in ("token_ids", "prompt_token_ids"):
                    if key in choice:
                        del choice[key]
                        changed = True
    return changed


def _null_messages(resp: object) -> bool:
    """A Responses object's input_messages/output_messages set to null; True if any was not."""
    if not isinstance(resp, dict):
        return False
    changed = False
    for key in _MESSAGES:
        if resp.get(key) is not None:
            resp[key] = None
            changed = True
    return changed


def strippable_kv(data: bytes) -> bool:
    """The event has a kv_transfer_params key to strip: any but a lone 0.33 null one (one pass
    over the chunk in the usual cases: no key, or the null one)."""
    keys = data.count(KV_KEY)
    return keys > 1 or (keys == 1 and NULL_KV not in data)


def cut_ids(data: bytes) -> bytes | None:
    """An event without its token-id members; None where one is written otherwise. A
    streamed chunk's one list of one token's ids is cut with partitions, the rest (the first
    chunk's prompt ids, several ids, null) by `_IDS_MEMBER`."""
    head, key, tail = data.partition(ONE_IDS)
    if key:
        ids, _, after = tail.partition(b"]")
        if ids.isdigit():
            cut = head + after
            if not cut.partition(TOKEN_IDS_KEY)[1]:
                return cut
    elif not data.partition(TOKEN_IDS_KEY)[1]:
        return data
    return cut_every_id(data)


def cut_every_id(data: bytes) -> bytes | None:
    """Events without their token-id members, every one cut in one regex pass; None where
    one is written otherwise than vLLM writes it."""
    cut = _IDS_MEMBER.sub(b"", data)
    return None if cut.partition(TOKEN_IDS_KEY)[1] else cut
