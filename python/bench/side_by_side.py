"""FSDP2 with and without zeropp.torch, side by side (`cargo xtask bench torch`).

Runs under torchrun on every node of the namespace cluster (xtask/cluster.sh
--launcher each-node starts one torchrun per node namespace). For the small GPT
of tests/gpt.py at bf16 mixed precision, in one run:

- ``default``: FSDP2's own collectives (reshard_after_forward=True);
- ``qwz+qgz``: zeropp.torch.enable(hpz=False) (INT8 weights, two-hop INT4 gradients);
- ``qwz+qgz+hpz``: the same with zeropp's hpZ (the node's INT8 encodings kept
  for the backward gather, which then stays in the node);
- ``hpz`` (with ``--hpz-alone``): FSDP2's own collectives with hpZ's resharding.

Per variant: the median step time over the timed steps (after warm-up), the bytes
each rank handed to torch's collectives for other nodes (zeropp.torch.ByteCounter)
and the bytes the nodes' uplinks actually sent (the kernel's tx counters of the
interface gloo uses). Rank 0 writes one JSON file.

    python bench/side_by_side.py --out result.json [--steps 6 --warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import gpt  # noqa: E402
import zeropp.torch as zt  # noqa: E402


def uplink_tx() -> int:
    """Bytes this node's uplink has sent (the interface gloo uses)."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def run_variant(name: str, cfg: gpt.Config, args, ls: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(1)
    model = gpt.GPT(cfg)
    kw = {} if args.fp32 else {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.bfloat16)}
    # "hpz" alone is FSDP2's own (reshard_after_forward=local_size); with zeropp it is
    # zeropp's (the node's INT8 encodings kept for the backward gather).
    reshard = ls if name == "hpz" else True
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    if name.startswith("qwz"):
        zt.enable(model, local_size=ls, hpz=name.endswith("hpz"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times, inter, intra = [], [], []
    tx = torch.zeros(1, dtype=torch.float64)
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), generator=gen)
        dist.barrier()
        timed = step >= args.warmup
        if timed and step == args.warmup and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            tx -= uplink_tx()
        t0 = time.perf_counter()
        with zt.ByteCounter(ls) as bc:
            loss = model(x, x)
            loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if timed:
            times.append(time.perf_counter() - t0)
            inter.append(bc.inter)
            intra.append(bc.intra)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        tx += uplink_tx()
    dist.all_reduce(tx)  # sum over the nodes' uplinks
    mean_inter = torch.tensor([statistics.fmean(inter), statistics.fmean(intra)], dtype=torch.float64)
    dist.all_reduce(mean_inter)
    w = dist.get_world_size()
    # FSDP2's parameters are DTensors: numel() is the whole (unsharded) parameter's.
    params = sum(p.numel() for p in model.parameters())
    return {
        "variant": name,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "inter_bytes_per_rank": float(mean_inter[0]) / w,
        "intra_bytes_per_rank": float(mean_inter[1]) / w,
        "uplink_tx_bytes_per_step": float(tx[0]) / args.steps,
        "params": int(params),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--fp32", action="store_true", help="no mixed precision (the default is bf16)")
    ap.add_argument("--hpz-alone", action="store_true", help="also FSDP2's collectives with hpZ's resharding")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variants this many times, alternating; the step is the median over all")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    ls = zt.local_size()
    cfg = gpt.Config(d=args.d, layers=args.layers)
    # "hpz": FSDP2's own collectives with reshard_after_forward=local_size, what hpZ
    # costs FSDP2 without zeropp (on localhost its second copy is pure overhead).
    names = ("default", "qwz+qgz", "qwz+qgz+hpz") + (("hpz",) if args.hpz_alone else ())
    runs = {v: [] for v in names}
    for _ in range(args.rounds):
        for v in names:
            runs[v].append(run_variant(v, cfg, args, ls))
    rows = []
    for v in names:
        r = dict(runs[v][-1])
        r["step_s_all"] = [t for x in runs[v] for t in x["step_s_all"]]
        r["step_s"] = statistics.median(r["step_s_all"])
        r["round_medians"] = [x["step_s"] for x in runs[v]]
        rows.append(r)
    for r in rows:
        r["step_vs_default"] = r["step_s"] / rows[0]["step_s"]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"world": dist.get_world_size(), "local_size": ls, "config": vars(cfg), "fp32": args.fp32,
                       "rounds": args.rounds, "rows": rows}, f, indent=1)
        for r in rows:
            print(f"{r['variant']}: {r['step_s']:.3f} s/step ({r['step_vs_default']:.3f}x the default), "
                  f"{r['inter_bytes_per_rank']:.0f} B/rank to other nodes, "
                  f"uplinks {r['uplink_tx_bytes_per_step']:.0f} B/step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
