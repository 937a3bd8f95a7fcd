"""The chat template: BOS, then `<|role|>` + content + newline per message, then `<|assistant|>`.

Content is encoded message by message, so message boundaries never merge tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from vllm_sim.tokenizer import BOS_ID, Tokenizer


class TemplateError(ValueError):
    """A message the template cannot render (the server answers 400)."""


def message_text(content: Any) -> str:
    """A message's text: a string, null, or a list of text parts (joined with newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise TemplateError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError("a text content part needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise TemplateError("message content must be a string, a list of parts or null")


def render(
    tok: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the rendered conversation.

    Reasoning fields of assistant messages (`reasoning`, `reasoning_content`) are dropped,
    as reasoning models' templates do (vllm#43094).
    """
    ids = [BOS_ID]
    newline = tok.encode("\n")
    for msg in messages:
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise TemplateError("every message needs a string 'role'")
        # Known roles map to their special token; others are spelled out as text.
        ids.extend(tok.encode(f"<|{role}|>"))
        ids.extend(tok.encode(message_text(msg.get("content"))))
        ids.extend(newline)
    if add_generation_prompt:
        ids.extend(tok.encode("<|assistant|>"))
    return ids
