"""The compute of one training step in PyTorch, one process and one thread, for
`cargo xtask bench torch`'s compute row: the GPT of tests/gpt.py in float32,
AdamW, no distribution, beside zeropp's engine on one rank (`zeropp train
--world 1`) on the same shape. What is left of their ratio is the two
implementations' kernels (GEMM, attention, layer norm, GELU, the optimizer).

    python bench/compute.py --d 64 --layers 2 --seq 64 --batch 16 --steps 30 --warmup 5

Prints one JSON line: the median step time over the timed steps, and each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import gpt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    cfg = gpt.Config(vocab=args.vocab, seq=args.seq, d=args.d, layers=args.layers, heads=args.heads)
    model = gpt.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=gen)
        t0 = time.perf_counter()
        loss = model(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    print(json.dumps({"step_s": statistics.median(times), "steps": times, "threads": torch.get_num_threads(),
                      "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
