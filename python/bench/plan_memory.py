"""FSDP2's tracked memory peak per rank against `zeropp plan --framework fsdp2`'s
memory model (`cargo xtask bench plan`, its `memory` part).

Under torchrun as 2 nodes x 2 (ZEROPP_LOCAL_SIZE=2), a Hugging Face
``LlamaForCausalLM`` of the shape given, ``fully_shard`` on every decoder layer
and on the root (both given ``reshard_after_forward``, or the root left at
FSDP2's default with ``--root-default``), bf16 mixed precision,
AdamW, one sequence of ``--tokens`` per rank. torch's profiler tracks every CPU
tensor allocation from before the model is built (``profile_memory=True``:
its "Total Allocated" is the CPU analogue of ``torch.cuda.memory_allocated``),
and the peak is the largest "Total Allocated" inside the measured steps (after
one of warm-up). Rank 0 writes every rank's peak to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.profiler import ProfilerActivity, profile, record_function

import zeropp.torch as zt
from _llama import add_shape_args, build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fsdp2", "fsdp2-hpz", "zeropp-torch"), required=True)
    ap.add_argument("--out", required=True)
    add_shape_args(ap, vocab=8000)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true", help="HF's gradient checkpointing on every layer")
    ap.add_argument("--root-default", action="store_true",
                    help="the root at FSDP2's default (no reshard_after_forward given): held gathered")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    ls = zt.local_size()
    trace = f"{args.out}.rank{dist.get_rank()}.trace.json"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = build(args)
        if args.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        reshard = ls if args.mode == "fsdp2-hpz" else True
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
        if args.root_default:
            fully_shard(model, mp_policy=mp)
        else:
            fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
        if args.mode == "zeropp-torch":
            zt.enable(model, local_size=ls)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1 + dist.get_rank())
        for step in range(1 + args.steps):
            x = torch.randint(0, args.vocab, (1, args.tokens), generator=gen)
            with record_function("measured" if step else "warmup"):
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
    prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("name") == "measured"]
    if not spans:
        raise SystemExit("plan_memory.py: the profiler recorded no measured step")
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    peak = max(e["args"]["Total Allocated"] for e in events
               if e.get("name") == "[memory]" and lo <= e["ts"] <= hi)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "params": params, "peak_bytes": peaks,
                       "checkpointing": args.checkpointing, "root_default": args.root_default}, f)
        print(f"{args.mode}: {params} parameters, tracked peak per rank {peaks}", flush=True)
    if args.mode == "zeropp-torch":
        zt.release()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
