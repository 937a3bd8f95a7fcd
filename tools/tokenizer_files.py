"""The two tokenizer.json files tools/tokenize_cost.py times (a scratch venv with `tokenizers`).

tiny.json: the byte-level BPE of shared/reference/vllm-cpu/build_tiny_model.py (4096 ids, trained
on stdlib sources), without torch. tekken.json: Mistral's Tekken (131072 ids, tiktoken-style
ranks; `tekken_240911.json` in the mistral-common wheel) made into an HF byte-level BPE as Llama
3's tokenizer.json is (a regex Split, ByteLevel without its regex, BPE with ignore_merges).

    python tools/tokenizer_files.py OUT_DIR mistral_common/data/tekken_240911.json
"""

from __future__ import annotations

import base64
import glob
import json
import os
import sys
from typing import Any

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|user|>", "<|assistant|>"]


def byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (ByteLevel's alphabet)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return {b: chr(b if b in keep else 256 + extra.index(b)) for b in range(256)}


def tekken(path: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # type: ignore[import-not-found, unused-ignore]

    with open(path) as f:
        data = json.load(f)
    nspec = data["config"]["default_num_special_tokens"]
    rows = data["vocab"][: data["config"]["default_vocab_size"] - nspec]
    ranks = {base64.b64decode(r["token_bytes"]): r["rank"] for r in rows}
    chars = byte_chars()

    def enc(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges = []  # each token's splits into two lower-ranked tokens, in the token's rank order
    for tok, rank in ranks.items():
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok))]
        ok = [
            (ranks[a], ranks[b], a, b)
            for a, b in splits
            if ranks.get(a, rank) < rank > ranks.get(b, rank)
        ]
        merges += [(rank, enc(a), enc(b)) for _, _, a, b in sorted(ok)]
    vocab = {enc(b): r + nspec for b, r in ranks.items()}
    vocab |= {s: i for i, s in enumerate(SPECIAL + [f"<SPECIAL_{i}>" for i in range(5, nspec)])}
    merges.sort(key=lambda m: m[0])
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True)
    out = Tokenizer(bpe)
    split = pre_tokenizers.Split(Regex(data["config"]["pattern"]), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    out.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    out.decoder = decoders.ByteLevel()
    out.add_special_tokens(SPECIAL)
    return out


def tiny() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found, unused-ignore]

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:120]
    out = Tokenizer(models.BPE())
    out.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    out.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=[*SPECIAL, "<|system|>"],
                                  initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    out.train(files, trainer)
    return out


if __name__ == "__main__":
    tiny().save(os.path.join(sys.argv[1], "tiny.json"))
    tekken(sys.argv[2]).save(os.path.join(sys.argv[1], "tekken.json"))
