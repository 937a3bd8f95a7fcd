"""Incremental output text: the reasoning/content split, stop strings and min_tokens.

Like vLLM's detokenizer, text that could still become a stop string is held back while
streaming, and stop strings are only looked for once min_tokens have been generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_sim.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDelta:
    reasoning: str
    content: str
    stop_reason: str | None  # the stop string that ended generation, if any


class OutputText:
    def __init__(
        self,
        tok: Tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> None:
        self._tok = tok
        self._stop = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._reasoning_tokens = reasoning_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.num_tokens = 0
        self.reasoning = ""
        self._full = ""  # content as generated
        self.content = ""  # content released so far

    def add(self, token_id: int) -> TextDelta:
        self.num_tokens += 1
        piece = self._tok.piece(token_id)
        if self.num_tokens <= self._reasoning_tokens:
            self.reasoning += piece
            return TextDelta(piece, "", None)
        before = len(self._full)
        self._full += piece
        if self._stop and self.num_tokens >= self._min_tokens:
            hit = self._find_stop(before)
            if hit is not None:
                idx, stop = hit
                end = idx + len(stop) if self._include else idx
                return TextDelta("", self._release(self._full[:end]), stop)
        visible = self._full[: len(self._full) - self._hold] if self._hold else self._full
        return TextDelta("", self._release(visible), None)

    def flush(self) -> str:
        """Release held-back text (generation ended without a stop string)."""
        return self._release(self._full)

    def _find_stop(self, before: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # Only occurrences that end in the new text count (earlier ones were ignored).
            idx = self._full.find(stop, max(0, before - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _release(self, visible: str) -> str:
        if len(visible) <= len(self.content):
            return ""
        delta = visible[len(self.content) :]
        self.content = visible
        return delta
