"""A small character-level GPT in plain PyTorch, and its data: the model the
FSDP2 tests and `cargo xtask bench torch` train with and without zeropp.

Nothing here knows about zeropp: it is the kind of script a user brings.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab: int = 96
    seq: int = 64
    d: int = 64
    layers: int = 2
    heads: int = 4


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d)
        self.qkv = nn.Linear(c.d, 3 * c.d)
        self.proj = nn.Linear(c.d, c.d)
        self.ln2 = nn.LayerNorm(c.d)
        self.fc = nn.Linear(c.d, 4 * c.d)
        self.out = nn.Linear(4 * c.d, c.d)
        self.heads = c.heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.d)
        self.pos = nn.Embedding(c.seq, c.d)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d)
        self.head = nn.Linear(c.d, c.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x)).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def shared_data_path() -> str:
    """tinyshakespeare beside the checkout (`../shared/data/`), or ZEROPP_SHAKESPEARE."""
    env = os.environ.get("ZEROPP_SHAKESPEARE")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "shared", "data", "tinyshakespeare.txt"))


class Corpus:
    """A text as byte tokens (printable ASCII mapped into `vocab`), split 90/10."""

    def __init__(self, text: str, vocab: int = 96):
        data = torch.tensor([min(max(ord(ch) - 32, 0), vocab - 1) if ch != "\n" else 0 for ch in text],
                            dtype=torch.long)
        cut = int(0.9 * len(data))
        self.train, self.val = data[:cut], data[cut:]

    def batch(self, split: str, gen: torch.Generator, batch: int, seq: int):
        data = self.train if split == "train" else self.val
        ix = torch.randint(len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + seq] for i in ix])
        y = torch.stack([data[i + 1:i + seq + 1] for i in ix])
        return x, y
