"""The simulators' tokenizer as a Hugging Face tokenizer folder (tokenizer.json and
tokenizer_config.json), for a client that counts tokens itself: vLLM's multi-turn benchmark
run against the simulators (bench/vllm_multiturn.py) loads it with `transformers`.

It splits text into the simulators' pieces (their pre-tokenizer, less the special tokens,
which the file lists apart) and gives each the simulators' id; a piece the simulators spell in
bytes is one unknown token here.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_sim.tokenizer import BYTE_BASE, NUM_BYTE_TOKENS, SPECIAL_TOKENS, WORD_PIECES, Tokenizer

UNK = "<|unk|>"


def write(dest: Path) -> None:
    """A Hugging Face tokenizer folder that splits text as the simulators do: the same
    pieces, the same ids (a piece the simulators spell in bytes is one unknown token here)."""
    tok = Tokenizer()
    vocab: dict[str, int] = {}
    for i in range(tok.vocab_size):
        if not BYTE_BASE <= i < BYTE_BASE + NUM_BYTE_TOKENS:
            vocab.setdefault(tok.piece(i), i)
    vocab[UNK] = tok.vocab_size
    plain = dict.fromkeys(("single_word", "lstrip", "rstrip", "normalized"), False)
    added = [
        {"id": vocab[text], "content": text, **plain, "special": True}
        for text in [*SPECIAL_TOKENS, UNK]
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": WORD_PIECES},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "unk_token": UNK,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    dest.mkdir(exist_ok=True)
    (dest / "tokenizer.json").write_text(json.dumps(spec))
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
