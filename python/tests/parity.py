"""Training parity under FSDP2 (issue 20, test 3): the small GPT of gpt.py on
tinyshakespeare, trained with FSDP2's default collectives and with
zeropp.torch (qwZ + qgZ + hpZ), over several seeds; the validation-loss ratio
zeropp / default is reported as mean, spread and worst seed.

Run under torchrun (one launch runs every seed and both variants):

    ZEROPP_LOCAL_SIZE=2 torchrun --nproc-per-node 4 python/tests/parity.py --seeds 5 --steps 300

Exits 1 when the mean ratio exceeds --max-mean (default 1.01, the goal). CI
(`cargo xtask test-torch`) runs 3 seeds x 120 steps at lr 1e-3 with --max-mean
1.005: there the loss falls smoothly on every seed and the ratio's spread over
seeds is 0.0005 (mean 1.0028), while at lr 3e-3 a 100-200-step run sits in the
loss plateau, where one seed's ratio swings from 0.87 to 1.10. The goal is
measured over 5 seeds x 1000 steps at lr 3e-3 (docs/PERFORMANCE.md). With
ZEROPP_SEEDED_DEFECT=wrong-levels (defects.py) it must fail (1.016 on seed 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import defects  # noqa: E402
import gpt  # noqa: E402
import zeropp.torch as zt  # noqa: E402


def train_one(corpus, cfg, seed, variant, args, ls):
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = gpt.GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if args.bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    # zeropp's recipe: FSDP2 reshards fully after forward, zeropp's hpZ keeps the
    # node's INT8 encodings for the backward gather (enable()'s default).
    reshard = True
    mesh = None
    if args.hsdp:
        # HSDP: a replica per node, sharded within it. FSDP2's default runs its native
        # mesh; zeropp shards over the shard dimension and takes the all-reduce over.
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size() // ls, ls), mesh_dim_names=("replicate", "shard"))
        kw["mesh"] = mesh["shard"] if variant == "zeropp" else mesh
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    if variant == "zeropp":
        extra = {"replicate": mesh["replicate"]} if args.hsdp else {}
        zt.enable(model, local_size=ls, seed=seed, **args.enable, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    t0 = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = corpus.batch("train", gen, args.batch, cfg.seq)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    train_s = time.perf_counter() - t0
    # Validation: the same batches on every rank and for both variants.
    vgen = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        losses = [model(*corpus.batch("val", vgen, args.batch, cfg.seq)).item() for _ in range(args.val_batches)]
    return sum(losses) / len(losses), train_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision (bf16 params and reduce)")
    ap.add_argument("--hsdp", action="store_true",
                    help="HSDP, a replica per node: zeropp takes over the replica all-reduce")
    ap.add_argument("--max-mean", type=float, default=1.01, help="fail above this mean ratio")
    ap.add_argument("--min-mean", type=float, default=0.99,
                    help="fail below this mean ratio too: far better than the default measures luck")
    ap.add_argument("--out", default="")
    ap.add_argument("--enable", default="", help="zeropp.torch.enable options, e.g. qwz=0,stochastic=0,qgz_bits=8")
    args = ap.parse_args()
    # Widths and sizes are numbers (qgz_bits=8), the switches booleans (stochastic=0).
    args.enable = {k: int(v) if k.endswith(("_bits", "group_size")) else bool(int(v))
                   for k, v in (kv.split("=") for kv in args.enable.split(",") if kv)}

    dist.init_process_group("gloo")
    defect = defects.apply_from_env()
    ls = zt.local_size()
    path = gpt.shared_data_path()
    if not os.path.exists(path):
        if dist.get_rank() == 0:
            print(f"SKIP: {path} is absent (tinyshakespeare, from ../shared/data/)")
        dist.destroy_process_group()
        sys.exit(3)
    with open(path, encoding="utf-8") as f:
        corpus = gpt.Corpus(f.read())
    cfg = gpt.Config()
    rows = []
    for seed in range(1, args.seeds + 1):
        base, tb = train_one(corpus, cfg, seed, "default", args, ls)
        zpp, tz = train_one(corpus, cfg, seed, "zeropp", args, ls)
        rows.append({"seed": seed, "default": base, "zeropp": zpp, "ratio": zpp / base,
                     "default_s": tb, "zeropp_s": tz})
        if dist.get_rank() == 0:
            print(f"seed {seed}: val loss default {base:.4f} zeropp {zpp:.4f} ratio {zpp / base:.4f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    mean = statistics.fmean(ratios)
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    summary = {
        "world": dist.get_world_size(), "local_size": ls, "seeds": args.seeds, "steps": args.steps,
        "bf16": args.bf16, "hsdp": args.hsdp, "enable": args.enable, "seeded_defect": defect, "mean_ratio": mean, "sd": sd,
        "se": sd / math.sqrt(len(ratios)), "worst": max(ratios), "best": min(ratios), "rows": rows,
    }
    ok = args.min_mean <= mean <= args.max_mean
    if dist.get_rank() == 0:
        print(f"parity: mean ratio {mean:.4f} (sd {sd:.4f}, se {summary['se']:.4f}), worst {max(ratios):.4f}, "
              f"best {min(ratios):.4f} over {len(ratios)} seeds{' (HSDP)' if args.hsdp else ''}: "
              f"{'PASS' if ok else 'FAIL'} (bounds {args.min_mean}-{args.max_mean}; "
              f"the goal of 1.01 {'met' if mean <= 1.01 else 'not met'})")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
