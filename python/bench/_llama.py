"""The Hugging Face Llama the benches build by shape: the flags that give the
shape and the untied ``LlamaForCausalLM`` they describe (``plan_memory.py``,
``fidelity_size.py``)."""

from __future__ import annotations

import argparse


def add_shape_args(ap: argparse.ArgumentParser, *, vocab: int) -> None:
    """``--hidden --layers --heads --kv-heads --ff --vocab --tokens`` (a 7M
    shape by default, ``vocab`` as the caller's)."""
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank per step (one sequence)")


def build(args):
    """The ``LlamaForCausalLM`` of ``args``' shape, untied embeddings (seed torch first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ff,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(512, args.tokens),
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)
