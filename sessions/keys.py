"""Every Redis key name kvbaton uses, in one place (a public contract: see docs/architecture.md)."""

from __future__ import annotations

CONVERSATION_PREFIX = "kvbaton:conv:"

# SCAN pattern matching every conversation HASH (and nothing else kvbaton writes).
CONVERSATION_PATTERN = CONVERSATION_PREFIX + "*"

# One STRING per history-addressed session: `<prefix_len> <conversation_id>`, under a digest
# of the conversation its D holds (docs/operations.md).
HISTORY_PREFIX = "kvbaton:hist:"

# One HASH: instance base URL -> JSON {"role", "state", "updated_at"}, written by the admin
# API and read by every replica (docs/operations.md).
INSTANCES_KEY = "kvbaton:instances"

# One ZSET per decode instance: conversation key -> when its live handle on that D was made
# (D pins the blocks of an unread handle; docs/operations.md, *Pinned handles*).
PINS_PREFIX = "kvbaton:pins:"

# One ZSET per conversation, in its slot: the digests of the handles it has had that were read
# or released -> until when D could still pin them (a handle is read at most once).
SPENT_PREFIX = "kvbaton:spent:"

# One STRING per stored Responses API response (`store`, `previous_response_id`): its signed
# record (the input items, the response object, the conversation it belongs to), with the
# TTL `--response-ttl` (docs/responses.md).
RESPONSE_PREFIX = "kvbaton:resp:"

# One HASH: the Redis server's run id as the routers last saw it, and since when (the store's
# history: a restart, a restore or a failover shows another run id; docs/reliability.md).
STORE_RUN_KEY = "kvbaton:store-run"


def conversation_key(tenant: str, conversation_id: str) -> str:
    """`kvbaton:conv:{<tenant>:<conversation_id>}`; the braces are a Redis Cluster hash tag."""
    if "{" in tenant or "}" in tenant or "{" in conversation_id or "}" in conversation_id:
        # A brace inside would move the hash tag and split one conversation across slots.
        raise ValueError("tenant and conversation id must not contain braces")
    return f"{CONVERSATION_PREFIX}{{{tenant}:{conversation_id}}}"


def split_conversation_key(key: str) -> tuple[str, str] | None:
    """(tenant, conversation_id) of a conversation key; None for any other key.

    Tenants never contain ':' (a hex hash or "default"); conversation ids may.
    """
    if not (key.startswith(CONVERSATION_PREFIX + "{") and key.endswith("}")):
        return None
    tenant, sep, conversation_id = key[len(CONVERSATION_PREFIX) + 1 : -1].partition(":")
    if not sep or not tenant or not conversation_id:
        return None
    return tenant, conversation_id


def spent_key(key: str) -> str:
    """`kvbaton:spent:{<tenant>:<conversation_id>}` for conversation key `key`: the same hash
    tag, so the claim's script reads and writes both in one slot on Redis Cluster."""
    if not key.startswith(CONVERSATION_PREFIX):
        raise ValueError("not a conversation key")
    return SPENT_PREFIX + key[len(CONVERSATION_PREFIX) :]


def history_key(tenant: str, digest: str) -> str:
    """`kvbaton:hist:{<tenant>:<digest>}`: the session whose D holds the conversation with that
    digest. Its own hash tag, so another slot than the conversation's HASH on Redis Cluster."""
    if "{" in tenant or "}" in tenant or not digest.isalnum():
        raise ValueError("tenant must not contain braces; digest must be hex")
    return f"{HISTORY_PREFIX}{{{tenant}:{digest}}}"


def pins_key(decode: str) -> str:
    """`kvbaton:pins:{<decode base URL>}`: the conversations holding a live handle on that D.
    The URL is the hash tag, so each D's index is one key in its own slot on Redis Cluster."""
    if not decode or "{" in decode or "}" in decode:
        # A brace inside would move the hash tag (and no URL needs one).
        raise ValueError("decode must be a non-empty URL without braces")
    return f"{PINS_PREFIX}{{{decode}}}"


def pin_sizes_key(decode: str) -> str:
    """`kvbaton:pins:{<decode base URL>}:sizes`: a HASH beside D's pin index, each indexed
    conversation's "<blocks> <tokens>" (the same hash tag: one slot with the index)."""
    return pins_key(decode) + ":sizes"


def pin_held_key(decode: str) -> str:
    """`kvbaton:pins:{<decode base URL>}:held`: a HASH beside D's pin index, each indexed
    conversation's blocks on D, their names joined by spaces ("0:17 0:18 0:40"; none for a
    handle noted by a router before these keys)."""
    return pins_key(decode) + ":held"


def pin_blocks_key(decode: str) -> str:
    """`kvbaton:pins:{<decode base URL>}:blocks`: a HASH beside D's pin index, each block of D
    its handles pin -> how many of them pin it; its HLEN is D's distinct pinned blocks."""
    return pins_key(decode) + ":blocks"


def response_key(tenant: str, response_id: str) -> str:
    """`kvbaton:resp:{<tenant>:<response_id>}`: a stored response, visible to its tenant only.
    Its own hash tag (the response id), so responses spread over a Redis Cluster's slots."""
    if "{" in tenant or "}" in tenant or "{" in response_id or "}" in response_id:
        raise ValueError("tenant and response id must not contain braces")
    return f"{RESPONSE_PREFIX}{{{tenant}:{response_id}}}"
