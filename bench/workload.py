"""The requests the sections send: a system prompt and a user message of one-token words, and
a short answer (its tokens for JSON and for streamed responses)."""

from __future__ import annotations

NONSTREAM_TOKENS = 16
STREAM_TOKENS = 32
SYSTEM_WORDS = 120
USER_WORDS = 40
