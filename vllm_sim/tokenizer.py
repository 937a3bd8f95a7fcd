"""Deterministic toy tokenizer: special tokens, a word vocabulary and a byte fallback.

Any text encodes; text made of vocabulary words with a leading space re-encodes to the same ids.
"""

from __future__ import annotations

import re
import string

from vllm_sim.words import COMMON, GENERATED

BOS_TEXT = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TEXT,
    EOS_TEXT,
    "<|pad|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|tool|>",
)
BOS_ID = 0
EOS_ID = 1
BYTE_BASE = len(SPECIAL_TOKENS)
NUM_BYTE_TOKENS = 256

# Pre-tokenizer: special tokens first, then a word (with an optional leading space), one
# digit, one other symbol, or one whitespace character.
_SPECIAL_ALT = "|".join(re.escape(s) for s in SPECIAL_TOKENS)
WORD_PIECES = r" ?[A-Za-z]+| ?[0-9]| ?[^A-Za-z0-9\s]|\s"
_PIECES = re.compile(rf"{_SPECIAL_ALT}|{WORD_PIECES}")


def _piece_strings() -> list[str]:
    words = [*COMMON, *(w.capitalize() for w in COMMON), *GENERATED]
    symbols = [*string.digits, *string.punctuation]
    pieces: list[str] = []
    for unit in (*words, *symbols):
        pieces.append(unit)
        pieces.append(" " + unit)
    pieces.extend([" ", "\n", "\t", "\r"])
    return pieces


class Tokenizer:
    """Encode text to ids and back. Stateless after construction; share one instance."""

    def __init__(self) -> None:
        self._strings: list[str] = list(SPECIAL_TOKENS)
        self._strings.extend("" for _ in range(NUM_BYTE_TOKENS))  # byte tokens decode as bytes
        self._piece_base = len(self._strings)
        self._strings.extend(_piece_strings())
        self._ids: dict[str, int] = {}
        for i, s in enumerate(self._strings):
            if i < BYTE_BASE or i >= self._piece_base:
                self._ids[s] = i
        # The toy model emits only generated words with a leading space, so its output
        # always re-tokenizes to the same ids (one piece per word).
        self.emittable: list[int] = [self._ids[" " + w] for w in GENERATED]

    @property
    def vocab_size(self) -> int:
        return len(self._strings)

    def token_id(self, text: str) -> int | None:
        """The id of a special token or a vocabulary piece, None for other text."""
        return self._ids.get(text)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _PIECES.findall(text):
            tid = self._ids.get(piece)
            if tid is not None:
                ids.append(tid)
            else:
                ids.extend(BYTE_BASE + b for b in piece.encode("utf-8"))
        return ids

    def is_special(self, token_id: int) -> bool:
        return 0 <= token_id < BYTE_BASE

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        pending = bytearray()
        for tid in ids:
            if BYTE_BASE <= tid < self._piece_base:
                pending.append(tid - BYTE_BASE)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if skip_special_tokens and self.is_special(tid):
                continue
            out.append(self.piece(tid))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def piece(self, token_id: int) -> str:
        """The text of one token (a byte token alone decodes to its Latin-1 character)."""
        if BYTE_BASE <= token_id < self._piece_base:
            return bytes([token_id - BYTE_BASE]).decode("latin-1")
        if 0 <= token_id < len(self._strings):
            return self._strings[token_id]
        return ""
