"""Training parity of zeropp.torch on a Hugging Face Llama, in the calm regime
(issue 37): FSDP2's default against ``zeropp.torch.enable`` (qwZ + qgZ +
zeropp's hpZ, the defaults) over seeds, one launch for every seed and both
variants, under torchrun as 2 nodes x 2:

    ZEROPP_LOCAL_SIZE=2 torchrun --nproc-per-node 4 python/bench/hf_parity.py \\
        --data ../shared/data/tinyshakespeare.txt --seeds 3 --steps 500 --out parity.json

The model is a ``LlamaForCausalLM`` (``transformers``) of a small shape
(``--d``, ``--layers``; grouped-query attention, SwiGLU, RMSNorm, RoPE: the
real thing, sized for a CPU), on the text's bytes as tokens (printable ASCII,
96 symbols). A run is calm when FSDP2's own loss varies by a few percent at
most between seeds and the text is much larger than the tokens a run sees, so
validation loss tracks training loss: the report gives both, per seed, with
the ratio zeropp / default of each, their mean, spread, standard error and
worst seed. Exit status 1 when the mean validation ratio leaves
``[--min-mean, --max-mean]`` or the worst seed exceeds ``--max-worst``.

``cargo xtask bench fidelity-size`` runs it at every size of its loss curve;
``cargo xtask test-torch`` (test 8) at the two smallest for 150 steps inside
a two-sided bound, and with ``ZEROPP_SEEDED_DEFECT=wrong-scale``
(``python/tests/defects.py``), which must fail it.
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
from torch.distributed.fsdp import fully_shard

import zeropp.torch as zt

VOCAB = 96


def tokens(path: str) -> torch.Tensor:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return torch.tensor([min(max(ord(ch) - 32, 0), VOCAB - 1) if ch != "\n" else 0 for ch in text],
                        dtype=torch.long)


def batch(data: torch.Tensor, gen: torch.Generator, n: int, seq: int):
    ix = torch.randint(len(data) - seq - 1, (n,), generator=gen)
    x = torch.stack([data[i:i + seq] for i in ix])
    y = torch.stack([data[i + 1:i + seq + 1] for i in ix])
    return x, y


def model_of(args, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.d, intermediate_size=int(args.d * 8 / 3) // 8 * 8,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def mean_loss(model, data, seed: int, args) -> float:
    """The loss over ``--eval-batches`` batches drawn the same way on every
    rank and for both variants."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        losses = [float(loss_of(model, *batch(data, gen, args.batch, args.seq))) for _ in range(args.eval_batches)]
    return sum(losses) / len(losses)


# zeropp.torch.enable's options of each variant (None: FSDP2's default).
# "zeropp" is the recipe (qgZ's rotation chosen from the gradients, "auto":
# on this model the MLP's down projections), "unrotated" the recipe without
# it, "qwz", "qgz" and "qgz-rtn" each switch alone on the unrotated recipe
# (qgZ with round-to-nearest for the last), "hadamard" with every group
# rotated (qgz_hadamard=True), "hadamard-down" with the down projections'
# groups rotated, chosen by name.
VARIANTS = {"default": None, "zeropp": {}, "unrotated": {"qgz_hadamard": False}, "qwz": {"qgz": False},
            "qgz": {"qwz": False, "qgz_hadamard": False},
            "qgz-rtn": {"qwz": False, "stochastic": False, "qgz_hadamard": False}, "g64": {"group_size": 64},
            "two-level": {"qgz_two_level": True}, "hadamard": {"qgz_hadamard": True},
            "hadamard-down": {"qgz_hadamard": lambda name: name.endswith("mlp.down_proj.weight")}}


def train_one(train, val, seed: int, variant: str, args, ls: int) -> dict:
    model = model_of(args, seed)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if VARIANTS[variant] is not None:
        zt.enable(model, local_size=ls, seed=seed, **VARIANTS[variant])
    marks = sorted({max(1, round(float(m) * args.steps)) for m in args.marks.split(",") if m})
    val_at = {}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    t0 = time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss_of(model, *batch(train, gen, args.batch, args.seq)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step + 1 in marks and step + 1 < args.steps:
            val_at[step + 1] = mean_loss(model, val, seed, args)
    val_at[args.steps] = mean_loss(model, val, seed, args)
    # Which parameters qgZ rotates at the end (the default's choice is the gradients').
    return {"val": val_at[args.steps], "train": mean_loss(model, train, seed, args), "val_at": val_at,
            "seconds": time.perf_counter() - t0, "rotated": zt.rotated(model)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1, help="the seeds are first-seed, first-seed + 1, ...")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", "--d", dest="d", type=int, default=128, help="width (--d is swallowed by torchrun)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--max-mean", type=float, default=1.01)
    ap.add_argument("--min-mean", type=float, default=0.99)
    ap.add_argument("--max-worst", type=float, default=1.02)
    ap.add_argument("--out", default="")
    ap.add_argument("--variants", default="zeropp",
                    help="variants against FSDP2's default, comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--marks", default="0.25,0.5,1",
                    help="fractions of the run at which the validation loss is also taken")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import defects

    defect = defects.apply_from_env()
    dist.init_process_group("gloo")
    ls = zt.local_size()
    data = tokens(args.data)
    cut = int(0.9 * len(data))
    train, val = data[:cut], data[cut:]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS or v == "default"]
    if unknown or not variants:
        others = ", ".join(k for k in VARIANTS if k != "default")
        raise SystemExit(f"hf_parity.py: --variants {args.variants}: expected one or more of {others}")
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        base = train_one(train, val, seed, "default", args, ls)
        runs = {v: train_one(train, val, seed, v, args, ls) for v in variants}
        # The headline ratio (and the bounds) are the first variant's.
        zpp = runs[variants[0]]
        rows.append({"seed": seed, "default": base, **runs, "val_ratio": zpp["val"] / base["val"],
                     "train_ratio": zpp["train"] / base["train"],
                     "ratios": {v: {"val": r["val"] / base["val"], "train": r["train"] / base["train"],
                                    "val_at": {k: r["val_at"][k] / base["val_at"][k] for k in base["val_at"]}}
                                for v, r in runs.items()}})
        if dist.get_rank() == 0:
            print(f"seed {seed}: val {base['val']:.4f} -> {zpp['val']:.4f} ({rows[-1]['val_ratio']:.4f}), "
                  f"train {base['train']:.4f} -> {zpp['train']:.4f} ({rows[-1]['train_ratio']:.4f})", flush=True)
            if args.out:
                # A long run stopped early keeps the seeds it finished.
                with open(args.out + ".partial", "w") as f:
                    json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    ratios = [r["val_ratio"] for r in rows]
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    base_val = [r["default"]["val"] for r in rows]
    summary = {
        "data": os.path.basename(args.data), "tokens": len(data),
        "tokens_per_run": args.steps * args.batch * args.seq * dist.get_world_size(), "args": vars(args),
        "mean_val_ratio": statistics.fmean(ratios), "sd": sd, "se": sd / math.sqrt(len(ratios)),
        "worst": max(ratios), "best": min(ratios),
        "mean_train_ratio": statistics.fmean(r["train_ratio"] for r in rows),
        "default_seed_spread": (max(base_val) - min(base_val)) / statistics.fmean(base_val), "rows": rows,
        "seeded_defect": os.environ.get("ZEROPP_SEEDED_DEFECT") if defect else None,
    }
    ok = args.min_mean <= summary["mean_val_ratio"] <= args.max_mean and summary["worst"] <= args.max_worst
    if dist.get_rank() == 0:
        print(f"hf parity on {summary['data']}: val ratio mean {summary['mean_val_ratio']:.4f} (sd {sd:.4f}, se "
              f"{summary['se']:.4f}), worst {summary['worst']:.4f}; train ratio mean {summary['mean_train_ratio']:.4f}; "
              f"FSDP2's own spread over seeds {summary['default_seed_spread']:.4f}: {'PASS' if ok else 'FAIL'}",
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
            if os.path.exists(args.out + ".partial"):
                os.remove(args.out + ".partial")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
