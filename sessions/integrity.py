"""Session integrity: an HMAC over what a turn reads back and acts on (D's handle, the digests
the new prompt is verified against, where the handle lives), bound to the conversation's key.

Anyone who can write Redis could otherwise point a handle at other blocks, or make any prompt
"verify", and P would read wrong KV into its prefix cache for every tenant (vllm#43094). The
secret comes from the deployment (`--session-secrets`, shared by replicas); the first secret
signs, every one of them verifies, so a secret is rotated by putting the new one first and
dropping the old one after `--session-ttl`. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import msgspec

from sessions.model import SessionState

_ENCODE = msgspec.json.Encoder(order="sorted").encode


def _message(key: str, s: SessionState) -> bytes:
    # Everything the next turn trusts when it decides to send the handle and how much of it.
    return _ENCODE(
        [
            key,
            s.turn,
            s.api,
            s.decode,
            s.decode_engine_id,
            s.decode_started,
            s.kv_transfer_params,
            s.prefix_digest,
            s.prefix_len,
            s.prompt_digest,
            s.prompt_len,
            s.token_count,
            s.block_size,
            list(s.block_digests),
            s.seq_digest,
            s.handle_expires_at,
        ]
    )


def mac(secret: str, key: str, state: SessionState) -> str:
    return hmac.new(secret.encode(), _message(key, state), hashlib.sha256).hexdigest()


def sign(secrets: Sequence[str], key: str, state: SessionState) -> SessionState:
    """The state with its `mac` (unchanged without secrets)."""
    if not secrets:
        return state
    return msgspec.structs.replace(state, mac=mac(secrets[0], key, state))


def authentic(secrets: Sequence[str], key: str, state: SessionState) -> bool:
    """Whether one of the secrets made the state's `mac` (always true without secrets)."""
    if not secrets:
        return True
    return any(hmac.compare_digest(state.mac, mac(s, key, state)) for s in secrets)
