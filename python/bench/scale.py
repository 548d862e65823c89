"""FSDP2 with and without zeropp.torch at real size (`cargo xtask bench torch-scale`).

One variant per launch (a process's peak memory is its own), under torchrun
as 2 nodes x 2 ranks on one machine (gloo, unshaped localhost):

    ZEROPP_LOCAL_SIZE=2 torchrun --nproc-per-node 4 python/bench/scale.py --variant zeropp --out z.json

The model is a Hugging Face ``LlamaForCausalLM`` of 99.5M parameters (vocab
32000, d 768, 8 layers, 12 heads with 4 key/value heads, MLP 2048, untied
embeddings), ``fully_shard`` per decoder layer and at the root, AdamW, one
sequence of 128 tokens per rank per step. ``default`` is FSDP2's own
collectives (``reshard_after_forward=True``); ``zeropp`` is
``zeropp.torch.enable``, on the kernels ``ZEROPP_TORCH_KERNELS`` chooses.
``--hpz`` picks the hpZ: zeropp's (the default: the node's INT8 encodings of
the forward gather kept for the backward one), FSDP2's
(``reshard_after_forward=local_size``, a copy in the parameters' dtype, with
either variant) or none.

Per variant, in one JSON file from rank 0:

- ``step_s``: the median step (forward, backward, optimizer) of the timed
  steps, after ``--warmup`` steps (FSDP2's lazy init, AdamW's state), and
  ``optimizer_s``, the median of AdamW's step and ``zero_grad`` alone;
- ``peak_bytes``: each rank's peak resident memory over the timed steps
  (``VmHWM``, reset by ``/proc/self/clear_refs`` after the warm-up, so the
  model's construction does not count), and ``peak_process_bytes`` from the
  process's start;
- ``split``: per step, the time inside torch.distributed's calls (waits),
  inside zeropp's kernels (Rust or torch-op), and the rest of zeropp's
  collectives (plumbing), the slowest rank's;
- ``retained_bytes``: what zeropp keeps between steps
  (``zeropp.torch.retained_bytes``), and ``shard_bytes``, the rank's
  parameter shard.
- ``uplink_tx_bytes_per_step``: what the nodes' uplinks sent per timed step,
  on the namespace cluster (``GLOO_SOCKET_IFNAME``; 0 elsewhere).

``--bf16`` shards with bf16 mixed precision (``MixedPrecisionPolicy``, bf16
gathers and reduces); without it everything is float32. ``cargo xtask bench
plan`` runs it on the namespace cluster against ``zeropp plan --framework
fsdp2``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp
import zeropp.torch as zt
from zeropp import _zeropp
from zeropp.torch import allreduce, collectives
from zeropp.torch import kernels as K
from side_by_side import uplink_tx


class Clock:
    """Seconds spent in named kinds of call, for the step split."""

    def __init__(self):
        self.t = {"waits": 0.0, "kernels": 0.0, "collectives": 0.0}
        self.depth = {"collectives": 0}

    def timed(self, kind: str, fn):
        clock = self

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock.t[kind] += time.perf_counter() - t0

        return wrapped

    def reset(self):
        for k in self.t:
            self.t[k] = 0.0


class _Timed:
    """A proxy whose method calls (a Rust class's) count as kernels."""

    def __init__(self, inner, clock: Clock):
        self._inner, self._clock = inner, clock

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            # A proxy handed to a Rust method is replaced by what it wraps.
            a = [x._inner if isinstance(x, _Timed) else x for x in a]
            return attr(*a, **k)

        return self._clock.timed("kernels", call)


def instrument(clock: Clock):
    """Wraps torch.distributed's collectives (waits), zeropp's Rust and
    torch-op kernels (kernels) and zeropp's collectives (their whole call)."""
    for name in ("all_to_all_single", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor",
                 "all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, clock.timed("waits", getattr(dist, name)))
    for name in ("quantize_segments", "dequantize_segments", "quantize", "dequantize"):
        setattr(_zeropp, name, clock.timed("kernels", getattr(_zeropp, name)))
    real_stages = _zeropp.QgzStages
    _zeropp.QgzStages = zeropp.QgzStages = lambda *a, **k: _Timed(real_stages(*a, **k), clock)
    if hasattr(collectives, "Layout"):
        real_init = collectives.Layout.__init__

        def layout_init(self, *a, **k):
            real_init(self, *a, **k)
            self.rust = _Timed(self.rust, clock)

        collectives.Layout.__init__ = layout_init
    if hasattr(K, "Encoder"):
        K.Encoder.put = clock.timed("kernels", K.Encoder.put)
        K.decode = clock.timed("kernels", K.decode)
        K.rotate = clock.timed("kernels", K.rotate)
    else:
        # The releases before issue 37 (the bench's "before" rows) had row-wise kernels.
        for name in ("quantize_rows", "dequantize_rows", "hadamard_rows"):
            setattr(K, name, clock.timed("kernels", getattr(K, name)))
    for cls in (collectives.QuantizedAllGather, collectives.QuantizedReduceScatter, allreduce.QuantizedAllReduce):
        cls.__call__ = clock.timed("collectives", cls.__call__)


def hwm_bytes() -> int:
    """This process's peak resident memory since the last reset (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_hwm():
    """Resets VmHWM to the current resident size (Linux's clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(512, args.tokens),
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=("default", "zeropp"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--hpz", choices=("zeropp", "fsdp2", "none"), default="zeropp",
                    help="zeropp's hpZ (INT8 node copy; reshard_after_forward=True), FSDP2's "
                         "(reshard_after_forward=local_size) or none; FSDP2's default takes fsdp2 or none")
    ap.add_argument("--enable", default="", help="zeropp.torch.enable options, e.g. qwz=0,qgz=0")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 mixed precision (MixedPrecisionPolicy: bf16 gathers and reduces)")
    args = ap.parse_args()
    args.enable = {k: v if v == "auto" else int(v) if k.endswith(("_bits", "group_size")) else bool(int(v))
                   for k, v in (kv.split("=") for kv in args.enable.split(",") if kv)}
    dist.init_process_group("gloo")
    ls = zt.local_size()
    clock = Clock()
    instrument(clock)
    model = llama(args)
    if args.variant == "default" and args.hpz == "zeropp":
        args.hpz = "none"
    reshard = ls if args.hpz == "fsdp2" else True
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)} \
        if args.bf16 else {}
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    if args.variant == "zeropp":
        # (hpz is passed only to turn it off, so the script also runs the releases
        # before zeropp's hpZ, with FSDP2's.)
        extra = {"hpz": False} if args.hpz == "none" else {}
        zt.enable(model, local_size=ls, **extra, **args.enable)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    times, opt_times, splits = [], [], []
    tx = torch.zeros(1, dtype=torch.float64)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            reset_hwm()
            tx -= uplink_tx()
        x = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=gen)
        dist.barrier()
        clock.reset()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
            opt_times.append(time.perf_counter() - t1)
            splits.append(dict(clock.t))
    tx += uplink_tx()
    if ls == 1 or dist.get_rank() % ls != 0:
        tx.zero_()  # one rank per node reads its node's uplink
    dist.all_reduce(tx)  # over the nodes' uplinks
    peak = torch.tensor([hwm_bytes()], dtype=torch.int64)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    proc = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    procs = [torch.zeros_like(proc) for _ in range(dist.get_world_size())]
    dist.all_gather(procs, proc)
    # The split of the median step, from the rank where zeropp's calls took longest.
    mid = sorted(range(len(times)), key=lambda i: times[i])[len(times) // 2]
    mine = splits[mid]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    slow = max(every, key=lambda s: s["collectives"] + s["waits"])
    inside = slow["collectives"]
    # Waits and kernels inside zeropp's collectives; FSDP2's own calls are waits too.
    split = {"waits_s": slow["waits"], "kernels_s": slow["kernels"],
             "plumbing_s": max(0.0, inside - slow["kernels"] - min(slow["waits"], inside)),
             "zeropp_calls_s": inside}
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    result = {
        "variant": args.variant, "hpz": args.hpz, "kernels": K.mode() if args.variant == "zeropp" else "-",
        "torch": torch.__version__, "world": dist.get_world_size(), "local_size": ls,
        "params": sum(p.numel() for p in model.parameters()), "tokens_per_rank": args.batch * args.tokens,
        "step_s": statistics.median(times), "step_s_all": times, "optimizer_s": statistics.median(opt_times),
        "peak_bytes": [int(p) for p in peaks], "peak_process_bytes": [int(p) for p in procs],
        "split": split, "shard_bytes": shard,
        "retained_bytes": zt.retained_bytes(model) if hasattr(zt, "retained_bytes") else None,
        "threads": torch.get_num_threads(), "bf16": args.bf16,
        # Bytes all nodes' uplinks sent per timed step (the namespace cluster's
        # GLOO_SOCKET_IFNAME; 0 elsewhere).
        "uplink_tx_bytes_per_step": float(tx[0]) / args.steps,
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{args.variant} (hpZ {args.hpz}, kernels {result['kernels']}): {result['step_s']:.3f} s/step, peak "
              f"{max(result['peak_bytes']) / 2**30:.3f} GiB (process {max(result['peak_process_bytes']) / 2**30:.3f}), "
              f"kept {result['retained_bytes']} B, split {split}", flush=True)
    # Every rank done before any tears its connections down.
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
