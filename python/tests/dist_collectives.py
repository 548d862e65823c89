"""zeropp.torch's collectives on a real process group (issue 20, test 2).

Run with 4 processes posing as 2 nodes x 2 ranks, gloo on localhost:

    ZEROPP_LOCAL_SIZE=2 torchrun --nproc-per-node 4 python/tests/dist_collectives.py

Checks, each against an independent reference:
1. QuantizedReduceScatter (qgZ) equals the float64 mean (and sum) of all ranks'
   inputs within the analytic INT4 bound, and equals, bit for bit, zeropp's
   stages run by hand in one process on all ranks' inputs (the Rust engine's
   code path; proven equal to the engine's collective by comm's proptest).
2. The 1-D segments (excluded from qgZ) are reduced at float32 precision.
3. QuantizedAllGather (qwZ) is within the INT8 bound of each rank's input, and
   every rank ends up with the same weights.
5. Frozen and unused parameters: with a frozen norm weight, a trainable
   parameter the forward never uses, or a LoRA fine-tune (frozen base, rank-4
   adapters), FSDP2 reduce-scatters only the parameters with a gradient;
   zeropp's gradients then match FSDP2's default ones (1-D parameters to
   float32 rounding, the rest within INT4's error with groups per parameter),
   and the others stay None, at both of two steps (a branch taken on the first
   only drops out of the second's reduce-scatter); with bf16 reduces too. The same on 2 x 2 HSDP meshes (sharded within a
   node and replicated across, or the other way round), where every rank's
   shard group differs.
4. Bytes: one training step of a small GPT under FSDP2 (bf16 mixed precision)
   with zeropp (qwZ + qgZ + hpZ) hands torch's collectives <= 0.27x the
   cross-node bytes of FSDP2's default collectives.
6. zeropp's hpZ (the INT8 encodings of the node's share of the forward
   gather, kept for the backward gather inside the node): the gradients equal
   FSDP2's hpZ's and no hpZ's bit for bit, the cross-node bytes equal FSDP2's
   hpZ's (fewer within the node), and nothing is kept after the step.
Exit status 0 when all pass. With ZEROPP_SEEDED_DEFECT=wrong-scale,
wrong-levels or hpz-wrong-rail (defects.py) it must fail.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import defects  # noqa: E402
import gpt  # noqa: E402
import zeropp  # noqa: E402
import zeropp.torch as zt  # noqa: E402
from zeropp.torch import kernels as K  # noqa: E402
from zeropp.torch.stages import TorchQgzStages  # noqa: E402

FAILURES: list[str] = []
# zeropp's own stages, taken before a seeded defect can replace them.
REAL_STAGES = zeropp.QgzStages


def check(ok: bool, what: str):
    if not ok:
        FAILURES.append(what)
    if dist.get_rank() == 0:
        print(("ok   " if ok else "FAIL ") + what, flush=True)


def rank_input(r: int, n: int) -> np.ndarray:
    """Rank r's gradient: a different magnitude per group of 64, some exact zeros."""
    rng = np.random.default_rng(1000 + r)
    x = rng.standard_normal(n).astype(np.float32)
    x *= np.repeat(rng.uniform(0.01, 3.0, n // 64 + 1).astype(np.float32), 64)[:n]
    x[rng.integers(0, n, n // 50)] = 0.0
    return x


def qgz_bound(inputs, w, nodes, local, shard, mean, bits=4, local_bits=8, gs=256, intra_bits=None,
              hadamard=False):
    """zeropp_comm::conformance::qgz_error_bound in numpy (float64): every
    quantization of a group errs by at most one step amax / 2^(b-1); the
    second hop requantizes each other node's partial sum. With ``hadamard``, a
    whole group is quantized rotated, where no value exceeds the group's L2
    norm, and rotating back multiplies an elementwise bound by at most
    sqrt(gs)."""
    n = len(inputs[0])
    s = -(-n // w)
    mt, lt = shard // local, shard % local
    step = lambda b: 1.0 / (1 << (b - 1))  # noqa: E731
    lo = shard * s
    xs = [np.abs(np.pad(x.astype(np.float64), (0, w * s - n))[lo:lo + s]) for x in inputs]
    shard_amax = [float(v.max()) if len(v) else 0.0 for v in xs]
    # Elements in a whole (rotated) group, with the rotation.
    whole = s // gs * gs
    rot = np.zeros(s, dtype=bool)
    if hadamard:
        rot[:whole] = True

    def block_max(v, g):
        pad = (-len(v)) % g
        blocks = np.pad(v, (0, pad)).reshape(-1, g)
        m = np.repeat(blocks.max(axis=1), g)[:len(v)]
        l2 = np.repeat(np.sqrt((blocks ** 2).sum(axis=1)), g)[:len(v)]
        return np.where(rot, l2, m)

    e = np.zeros(s)
    total = 0.0
    for m in range(nodes):
        partial = np.zeros(s)
        for l in range(local):
            r = m * local + l
            total += shard_amax[r]
            if local == 1:
                if m == mt:
                    continue
                b = bits
            elif l == lt:
                b = local_bits
            else:
                b = intra_bits or bits
            e += block_max(xs[r], gs) * step(b)
            partial += np.where(rot, block_max(xs[r], gs) * (1 + step(b) * np.sqrt(gs)),
                                shard_amax[r] * (1 + step(b)))
        if nodes > 1 and local > 1 and m != mt:
            e += partial * step(bits)
    e = np.where(rot, e * np.sqrt(gs), e)
    return (e + 1e-5 * total + 1e-30) * ((1.0 / w) if mean else 1.0)


class _TensorArgs:
    """Stages that take tensors, called with numpy arrays (shared memory)."""

    def __init__(self, st):
        self._st = st

    def __getattr__(self, name):
        attr = getattr(self._st, name)
        if not callable(attr):
            return attr
        return lambda *a: attr(*(torch.from_numpy(x) for x in a))


def by_hand(inputs, w, local, seed, mean, **options):
    """All ranks' qgZ shards from zeropp's stages in this process, with the two
    all-to-alls done by copying bytes (the comm crate's qgz_stages test does the
    same); ``options`` go to the stages (``intra_bits``, ``hadamard``)."""
    nodes = w // local
    n = len(inputs[0])
    if K.mode() == "torch":
        # The device path's own stages (their rounding streams are torch's), on
        # tensors that share the numpy buffers below.
        st = [_TensorArgs(TorchQgzStages(w, local, r, n, seed=seed, mean=mean, **options)) for r in range(w)]
    else:
        st = [REAL_STAGES(w, local, r, n, seed=seed, mean=mean, **options) for r in range(w)]
    ia, ie = st[0].intra_chunk_len, st[0].inter_chunk_len
    intra = [np.zeros(local * ia, np.uint8) for _ in range(w)]
    own = [np.zeros(st[0].own_len, np.uint8) for _ in range(w)]
    inter = [np.zeros(nodes * ie, np.uint8) for _ in range(w)]
    shard = [np.zeros(st[0].shard_len, np.float32) for _ in range(w)]
    for r in range(w):
        st[r].pack(inputs[r], intra[r], own[r], inter[r], shard[r])
    for r in range(w):
        m, l = divmod(r, local)
        recv = np.concatenate([intra[m * local + j][l * ia:(l + 1) * ia] for j in range(local)])
        st[r].reduce_intra(recv, own[r], inter[r], shard[r])
    for r in range(w):
        m, l = divmod(r, local)
        recv = np.concatenate([inter[k * local + l][m * ie:(m + 1) * ie] for k in range(nodes)])
        st[r].finish(recv, shard[r])
    return shard


def test_reduce_scatter(topo):
    w, ls, rank = topo.world, topo.local_size, dist.get_rank()
    c = 12_345
    n = w * c
    inputs = [rank_input(r, n) for r in range(w)]
    for op, mean in ((dist.ReduceOp.AVG, True), (dist.ReduceOp.SUM, False)):
        rs = zt.QuantizedReduceScatter(topo, seed=7)
        out = torch.empty(c)
        rs(out, torch.from_numpy(inputs[rank].copy()), topo.group, op)
        exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)[rank * c:(rank + 1) * c]
        if mean:
            exact /= w
        bound = qgz_bound(inputs, w, topo.nodes, ls, rank, mean)
        err = np.abs(out.numpy().astype(np.float64) - exact)
        ok = bool(np.all(err <= bound))
        worst = float(np.max(err / bound))
        ok = all_ok(ok)
        check(ok, f"qgZ reduce-scatter ({'mean' if mean else 'sum'}) within the analytic INT4 bound "
                  f"(rank 0: worst error/bound {worst:.3f})")
        ref = by_hand(inputs, w, ls, zeropp.stream_seed(7, [2, 1]), mean)[rank]
        same = all_ok(bool(np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))))
        check(same, f"qgZ reduce-scatter ({'mean' if mean else 'sum'}) bit-identical to zeropp's stages by hand")
    # SDP4Bit's options: INT8 inside the node, INT4 across, every group rotated.
    rs = zt.QuantizedReduceScatter(topo, seed=7, two_level=True, hadamard=True)
    out = torch.empty(c)
    rs(out, torch.from_numpy(inputs[rank].copy()), topo.group, dist.ReduceOp.AVG)
    exact = (np.sum([x.astype(np.float64) for x in inputs], axis=0) / w)[rank * c:(rank + 1) * c]
    bound = qgz_bound(inputs, w, topo.nodes, ls, rank, True, intra_bits=8, hadamard=True)
    err = np.abs(out.numpy().astype(np.float64) - exact)
    check(all_ok(bool(np.all(err <= bound))), f"qgZ two-level + Hadamard within its analytic bound of the float64 "
          f"mean (rank 0: worst error/bound {float(np.max(err / bound)):.3f})")
    ref = by_hand(inputs, w, ls, zeropp.stream_seed(7, [2, 1]), True, intra_bits=8,
                  hadamard=zeropp.stream_seed(7, [3, 1]))[rank]
    same = all_ok(bool(np.array_equal(out.numpy().view(np.uint32), ref.view(np.uint32))))
    check(same, "qgZ two-level + Hadamard bit-identical to zeropp's stages by hand")
    # 1-D segments at full precision: chunk layout [1000 matrix, 345 bias-like, 11000 matrix].
    segs = [(1000, False), (345, True), (11_000, False)]
    rs = zt.QuantizedReduceScatter(topo, segments=segs, seed=7)
    out = torch.empty(c)
    rs(out, torch.from_numpy(inputs[rank].copy()), topo.group, dist.ReduceOp.AVG)
    exact = (np.sum([x.astype(np.float64) for x in inputs], axis=0) / w)[rank * c:(rank + 1) * c]
    one_d = np.abs(out.numpy()[1000:1345] - exact[1000:1345])
    # float32 summation of w terms: a few ulps of the sum of magnitudes.
    mag = (np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0) / w)[rank * c:(rank + 1) * c]
    ok = all_ok(bool(np.all(one_d <= 4 * 2.0 ** -24 * w * mag[1000:1345] + 1e-30)))
    check(ok, "1-D segments reduced at float32 precision (not through INT4)")
    # Low-precision reduce dtypes (FSDP2's MixedPrecisionPolicy(reduce_dtype=...)): the
    # values against the float64 mean of what the ranks sent, within the INT4 bound plus
    # the output's own rounding (half an ulp: 2^-8 relative in bf16, 2^-11 in fp16).
    for dt, eps in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
        low = [torch.from_numpy(x).to(dt) for x in inputs]
        vals = [t.to(torch.float64).numpy() for t in low]
        exact = (np.sum(vals, axis=0) / w)[rank * c:(rank + 1) * c]
        rs = zt.QuantizedReduceScatter(topo, seed=7)
        out = torch.empty(c, dtype=dt)
        rs(out, low[rank].clone(), topo.group, dist.ReduceOp.AVG)
        bound = qgz_bound([v.astype(np.float32) for v in vals], w, topo.nodes, ls, rank, True) \
            + eps * np.abs(exact) * (1 + 2.0 ** -10)
        err = np.abs(out.to(torch.float64).numpy() - exact)
        check(all_ok(bool(np.all(err <= bound))), f"qgZ reduce-scatter in {dt} within the INT4 bound of the float64 "
              f"mean (rank 0: worst error/bound {float(np.max(err / bound)):.3f})")
        rs = zt.QuantizedReduceScatter(topo, segments=segs, seed=7)
        out = torch.empty(c, dtype=dt)
        rs(out, low[rank].clone(), topo.group, dist.ReduceOp.AVG)
        mag = (np.sum(np.abs(vals), axis=0) / w)[rank * c:(rank + 1) * c][1000:1345]
        tol = eps * np.abs(exact[1000:1345]) * (1 + 2.0 ** -10) + 4 * 2.0 ** -24 * w * mag + 1e-30
        err = np.abs(out[1000:1345].to(torch.float64).numpy() - exact[1000:1345])
        check(all_ok(bool(np.all(err <= tol))), f"1-D segments in {dt}: the float64 mean to the output's rounding "
              f"(rank 0: worst error/bound {float(np.max(err / tol)):.3f})")


def test_all_gather(topo):
    w, rank = topo.world, dist.get_rank()
    n = 5_000
    # One vector, and the per-parameter layout enable() gives (a 1-D segment travels exact).
    for segs in (None, [(1000, False), (345, True), (3655, False)]):
        ag = zt.QuantizedAllGather(topo.local_size, segments=segs)
        label = "per-parameter" if segs else "one vector"
        bounds = segs or [(n, False)]
        for dt in (torch.float32, torch.bfloat16):
            shards = [torch.from_numpy(rank_input(100 + r, n)).to(dt) for r in range(w)]
            out = torch.empty(w * n, dtype=dt)
            ag(out, shards[rank].clone(), topo.group)
            ok = True
            worst = 0.0
            for r in range(w):
                x = shards[r].double().numpy()
                y = out[r * n:(r + 1) * n].double().numpy()
                at = 0
                for k, exact in bounds:
                    xs, ys = x[at:at + k], y[at:at + k]
                    if exact:
                        ok &= bool(np.array_equal(xs, ys))
                    else:
                        # One INT8 step of the group's amax (groups restart at each
                        # parameter; the clipped maximum; up to ~127 ulps of float32
                        # rounding in the stored scale), plus bf16's rounding of the result.
                        amax = np.repeat(np.abs(np.pad(xs, (0, (-k) % 256))).reshape(-1, 256).max(axis=1), 256)[:k]
                        tol = amax / 128 * (1 + 2.0 ** -12) + (np.abs(xs) * 2.0 ** -8 if dt == torch.bfloat16 else 0.0)
                        err = np.abs(ys - xs)
                        ok &= bool(np.all(err <= tol + 1e-30))
                        worst = max(worst, float(np.max(err / (tol + 1e-30))))
                    at += k
            check(all_ok(ok), f"qwZ all-gather ({label}, {dt}) within the INT8 bound, 1-D segments exact "
                              f"(rank 0: worst error/bound {worst:.3f})")
            digest = torch.tensor([float(out.double().sum()), float((out.double() ** 2).sum())], dtype=torch.float64)
            gathered = [torch.empty_like(digest) for _ in range(w)]
            dist.all_gather(gathered, digest)
            check(all(torch.equal(g, gathered[0]) for g in gathered),
                  f"qwZ all-gather ({label}, {dt}): every rank has the same weights")


def all_ok(ok: bool) -> bool:
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t)
    return int(t.item()) == 0


def step_bytes(variant: str, ls: int):
    """Cross-node and intra-node bytes of one forward+backward of the small GPT
    (bf16 mixed precision), as counted by zeropp.torch.ByteCounter."""
    cfg = gpt.Config(d=128, layers=2, heads=4, seq=64)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # zeropp's recipe: FSDP2 reshards fully after forward, zeropp's hpZ keeps the node's
    # INT8 encodings for the backward gather.
    reshard = True
    # HSDP 2 x 2 (a replica per node): FSDP2's native mesh, or zeropp's take-over
    # of the replica all-reduce (the shard dimension's 1-D mesh + the hook).
    mesh = _hsdp_mesh("hsdp") if variant.startswith("hsdp") else None
    kw = {"mp_policy": mp}
    if variant == "hsdp-default":
        kw["mesh"] = mesh
    elif variant == "hsdp-zeropp":
        kw["mesh"] = mesh["shard"]
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    if variant == "zeropp":
        zt.enable(model, local_size=ls)
    elif variant == "hsdp-zeropp":
        zt.enable(model, local_size=ls, replicate=mesh["replicate"])
    x = torch.randint(0, cfg.vocab, (4, cfg.seq))
    model(x, x).backward()  # warm-up: lazy init outside the count
    with zt.ByteCounter(ls) as bc:
        model(x, x).backward()
    return bc.inter, bc.intra, dict(bc.calls)


def test_bytes(ls):
    base = step_bytes("default", ls)
    zpp = step_bytes("zeropp", ls)
    ratio = zpp[0] / base[0]
    check(all_ok(ratio <= 0.27), f"cross-node bytes zeropp/default = {ratio:.4f} (<= 0.27): "
          f"{zpp[0]} vs {base[0]} bytes per rank per step; intra-node {zpp[1]} vs {base[1]}")
    out = {"default": base, "zeropp": zpp, "inter_ratio": ratio}
    if dist.get_world_size() == 4 and ls == 2:
        hb, hz = step_bytes("hsdp-default", ls), step_bytes("hsdp-zeropp", ls)
        hr = hz[0] / hb[0]
        # INT4 out + INT8 back for each slice against bf16 both ways: 0.375, plus scales.
        check(all_ok(0.3 <= hr <= 0.40), f"HSDP 2 x 2 cross-node bytes, zeropp's all-reduce / torch's = {hr:.4f} "
              f"(0.30-0.40): {hz[0]} vs {hb[0]} bytes per rank per step; intra-node {hz[1]} vs {hb[1]}")
        out.update({"hsdp-default": hb, "hsdp-zeropp": hz, "hsdp_inter_ratio": hr})
    return out


def _variant_model(case: str, cfg):
    """The small GPT with what a fine-tune does to it (``case``)."""
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    if case in ("hsdp", "hsdp-across", "hsdp-hook", "bf16", "fp16", "divide"):
        pass
    elif case == "frozen-norm":
        model.blocks[0].ln1.weight.requires_grad_(False)
    elif case == "unused":
        model.blocks[1].unused = torch.nn.Parameter(torch.randn(16, 16) * 0.02)
    elif case == "sometimes":
        # A branch the forward takes on the first step only (its gradient is
        # missing from the second step's reduce-scatter).
        extra = model.blocks[0]
        extra.side = torch.nn.Linear(cfg.d, cfg.d)
        extra.use_side = True
        extra.register_forward_hook(lambda m, inp, out: out + m.side(out) if m.use_side else out)
    elif case == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        for blk in model.blocks:
            blk.lora_a = torch.nn.Parameter(torch.randn(cfg.d, 4) * 0.02)
            blk.lora_b = torch.nn.Parameter(torch.randn(4, cfg.d) * 0.02)
            # Registered before fully_shard, so it runs while the block is unsharded.
            blk.register_forward_hook(lambda m, inp, out: out + (inp[0] @ m.lora_a) @ m.lora_b)
    return model


def _grads(case: str, variant: str, ls: int, mesh=None, take_over: bool = False):
    """Each parameter's local gradient shard (None where FSDP2 left none) after
    two forward+backward passes (the second into zeroed gradients), sharded
    over ``mesh`` (all ranks when None)."""
    cfg = gpt.Config(d=64, layers=2, heads=4, seq=32)
    model = _variant_model(case, cfg)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case)
    # fp16 reduces: FSDP2 pre- and post-divides around a SUM (overflow), bf16 sends AVG.
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low) if low else None
    # hsdp-hook: FSDP2's native HSDP against zeropp's take-over of its all-reduce
    # (a 1-D mesh of the shard dimension, the replicas through the all-reduce hook).
    hook = take_over and variant == "zeropp"
    kw = {"mesh": mesh["shard"] if hook else mesh, **({"mp_policy": mp} if mp else {})}
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    if variant == "zeropp":
        # qgZ alone: the weights the forward sees are FSDP2's own.
        zt.enable(model, local_size=ls, qwz=False, replicate=mesh["replicate"] if hook else None)
        if case == "divide":
            # FSDP2 then sends PREMUL_SUM(1 / DIVIDE) (gloo itself has no PREMUL_SUM,
            # so the default run keeps its mean; the check rescales it).
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(DIVIDE)
    # Each rank its own data: a reduction that leaves a rank out must show.
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    steps = []
    for step in range(2):
        for p in model.parameters():
            p.grad = None
        if case == "sometimes":
            model.blocks[0].use_side = step == 0
        x = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g)
        model(x, x).backward()
        steps.append({name: None if p.grad is None else p.grad.to_local().detach().clone()
                      for name, p in model.named_parameters()})
    return steps


def _hsdp_mesh(kind: str):
    """A 2 x 2 HSDP mesh (rows are the shard groups) on 2 nodes x 2: ``hsdp``
    shards within a node and replicates across nodes; ``hsdp-across`` shards
    across nodes and replicates within one."""
    from torch.distributed.device_mesh import DeviceMesh
    rows = [[0, 1], [2, 3]] if kind == "hsdp" else [[0, 2], [1, 3]]
    return DeviceMesh("cpu", rows, mesh_dim_names=("replicate", "shard"))


# The gradient divide factor of the "divide" case (world 4: a sum scaled by 1/2).
DIVIDE = 2.0


def test_partial_grads(ls):
    cases = [("frozen-norm", None), ("unused", None), ("sometimes", None), ("lora", None), ("bf16", None),
             ("fp16", None), ("divide", None)]
    if dist.get_world_size() == 4 and ls == 2:
        cases += [("hsdp", "hsdp"), ("hsdp-across", "hsdp-across"), ("lora+hsdp", "hsdp"),
                  ("hsdp-hook", "hsdp"), ("lora+hsdp-hook", "hsdp")]
    for case, mesh_kind in cases:
        try:
            mesh = _hsdp_mesh(mesh_kind) if mesh_kind else None
            model_case = case.split("+")[0]
            take_over = case.endswith("hsdp-hook")
            base = _grads(model_case, "default", ls, mesh)
            zpp = _grads(model_case, "zeropp", ls, mesh, take_over)
        except Exception as e:  # noqa: BLE001 - the message is the finding
            check(all_ok(False), f"{case}: zeropp.torch raised {type(e).__name__}: {e}")
            continue
        ok, worst, why = True, 0.0, ""
        # PREMUL_SUM's definition: the sum over ranks / DIVIDE = the mean x world / DIVIDE.
        scale = dist.get_world_size() / DIVIDE if case == "divide" else 1.0
        pairs = [(f"step {k + 1} {name}", None if b is None else b * scale, zs[name])
                 for k, (bs, zs) in enumerate(zip(base, zpp)) for name, b in bs.items()]
        for name, b, z in pairs:
            if b is None or z is None:
                if (b is None) != (z is None):
                    ok, why = False, f"{name}: default grad {'None' if b is None else 'set'}, zeropp's " \
                                     f"{'None' if z is None else 'set'}"
                continue
            if b.dim() == 1:
                # bf16 reduces: both sum in bf16, maybe in another order.
                # bf16/fp16: FSDP2 sums in the reduce dtype, zeropp in float32 (its error
                # is the cast), so they differ by FSDP2's rounding: a few ulps at the
                # tensor's scale (test_reduce_scatter checks zeropp's against float64).
                eps = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}.get(case)
                rtol, atol = (4 * eps, 4 * eps * float(b.float().abs().max())) if eps else (1e-5, 1e-8)
                if not torch.allclose(z.float(), b.float(), rtol=rtol, atol=atol):
                    ok, why = False, f"{name} (1-D) differs from FSDP2's: max {float((z - b).abs().max()):.3g}"
            elif b.numel():
                rel = float((z.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                worst = max(worst, rel)
                # Every rank has its own data, so the mean gradient is smaller than each
                # rank's and INT4's error relative to it larger: 0.10-0.21 here, while a
                # rank or a replica left out of the reduction gives 0.6-1.0.
                if rel > 0.3:
                    ok, why = False, f"{name}: relative error {rel:.3f} > 0.3 (INT4, groups per parameter)"
        if take_over:
            # Every replica must hold the same gradients (else the replicas drift apart).
            digest = torch.tensor([float(z.double().sum()) + float((z.double() ** 2).sum())
                                   for zs in zpp for z in zs.values() if z is not None], dtype=torch.float64)
            reps = mesh["replicate"].get_group()
            seen = [torch.empty_like(digest) for _ in range(reps.size())]
            dist.all_gather(seen, digest, group=reps)
            if not all(torch.equal(d, seen[0]) for d in seen):
                ok, why = False, "the replicas' gradients differ"
        precision = case if case in ("bf16", "fp16") else "float32"
        check(all_ok(ok), f"{case}: zeropp's gradients match FSDP2's (1-D to {precision} rounding, worst relative "
                          f"error {worst:.3f} on rank 0){'; ' + why if why else ''}")


def _group_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def test_groups_reused(ls):
    """A second enable() (another model, same mesh) creates no sub-groups;
    release() destroys the ones enable() made, and enable() works after it."""
    def enabled():
        cfg = gpt.Config(d=32, layers=1, heads=2, seq=8)
        torch.manual_seed(0)
        model = gpt.GPT(cfg)
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        zt.enable(model, local_size=ls)
        return model, cfg
    enabled()
    before = _group_count()
    model, cfg = enabled()
    x = torch.randint(0, cfg.vocab, (2, cfg.seq))
    model(x, x).backward()
    after = _group_count()
    destroyed = zt.release()
    released = _group_count()
    model, _ = enabled()
    model(x, x).backward()
    check(all_ok(after == before and destroyed > 0 and released == after - destroyed),
          f"a second enable() reuses its sub-groups ({before} groups before it, {after} after), release() "
          f"destroys them ({destroyed} destroyed, {released} left), and enable() works after it")
    zt.release()


def test_replicate_errors(ls):
    """enable(replicate=...) refuses what cannot work, with the fix in the
    message: a native HSDP mesh (torch runs that all-reduce itself), a replica
    group that meets the shard group in more than this rank, a 2-D mesh, and
    anything that is not a group or a mesh."""
    if dist.get_world_size() != 4 or ls != 2:
        return

    def model_on(mesh):
        cfg = gpt.Config(d=32, layers=1, heads=2, seq=8)
        torch.manual_seed(0)
        m = gpt.GPT(cfg)
        kw = {} if mesh is None else {"mesh": mesh}
        for blk in m.blocks:
            fully_shard(blk, **kw)
        fully_shard(m, **kw)
        return m

    def raises(kind, fn, says):
        try:
            fn()
        except kind as e:
            return says in str(e)
        except Exception as e:  # noqa: BLE001 - the wrong kind of error is a failure too
            print(f"  unexpected {type(e).__name__}: {e}", flush=True)
            return False
        return False

    mesh = _hsdp_mesh("hsdp")
    native = raises(zeropp.ZeroppError, lambda: zt.enable(model_on(mesh), local_size=ls,
                                                          replicate=mesh["replicate"]), "native HSDP mesh")
    # Sharded over the whole world, with a "replica" group that holds a shard peer.
    overlap = dist.new_group([0, 1, 2, 3])
    crossing = raises(zeropp.ZeroppError, lambda: zt.enable(model_on(None), local_size=ls, replicate=overlap),
                      "must share exactly this rank")
    two_d = raises(zeropp.ZeroppError, lambda: zt.enable(model_on(mesh["shard"]), local_size=ls, replicate=mesh),
                   "takes a 1-D mesh")
    not_group = raises(TypeError, lambda: zt.enable(model_on(mesh["shard"]), local_size=ls, replicate=3),
                       "takes a ProcessGroup or a 1-D DeviceMesh, not a int")
    check(all_ok(native and crossing and two_d and not_group),
          f"enable(replicate=...) errors: native HSDP mesh {native}, overlapping groups {crossing}, "
          f"2-D mesh {two_d}, not a group {not_group}")
    zt.release()


def hpz_step(kind: str, ls: int):
    """One forward+backward of the small GPT (float32) with qwZ + qgZ and an
    hpZ of ``kind``: ``zeropp`` (zeropp's, the node's INT8 encodings kept for
    the backward gather; ``reshard_after_forward=True``), ``fsdp2`` (FSDP2's
    own, ``reshard_after_forward=local_size``) or ``none`` (the backward
    gathers over every node again). Returns the local gradients, the bytes
    across and within nodes, enable()'s hpZ summary and the bytes kept."""
    cfg = gpt.Config(d=64, layers=2, heads=4, seq=32)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    reshard = ls if kind == "fsdp2" else True
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    summary = zt.enable(model, local_size=ls, hpz=kind != "none", seed=3)
    x = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    with zt.ByteCounter(ls) as bc:
        model(x, x).backward()
    grads = {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, bc.inter, bc.intra, summary["hpz"], zt.retained_bytes(model)


def test_hpz(ls):
    """zeropp's hpZ: the backward gather runs inside the node from the INT8
    encodings the forward decoded, so the gradients are bit for bit those of
    FSDP2's hpZ and of no hpZ (every gather decodes the same bytes), the
    bytes across nodes are FSDP2's hpZ's, and nothing is kept after the step."""
    if dist.get_world_size() < 4 or ls < 2:
        return
    runs = {k: hpz_step(k, ls) for k in ("zeropp", "fsdp2", "none")}
    g = {k: r[0] for k, r in runs.items()}
    same = all(set(g[k]) == set(g["none"]) and all(torch.equal(g[k][n], g["none"][n]) for n in g[k])
               for k in ("zeropp", "fsdp2"))
    check(all_ok(same), "hpZ: zeropp's INT8 node copy gives the gradients of FSDP2's hpZ and of no hpZ, bit for bit")
    kinds = {k: sorted(set(map(str, r[3]))) for k, r in runs.items()}
    check(all_ok("zeropp" in kinds["zeropp"] and "fsdp2" in kinds["fsdp2"] and kinds["none"] == ["None"]),
          f"hpZ: enable() reports the hpZ each module got ({kinds})")
    inter = {k: r[1] for k, r in runs.items()}
    intra = {k: r[2] for k, r in runs.items()}
    check(all_ok(inter["zeropp"] == inter["fsdp2"] < inter["none"] and intra["zeropp"] < intra["fsdp2"]),
          f"hpZ: zeropp's backward gather stays in the node at INT8: bytes across nodes {inter} (zeropp == "
          f"FSDP2's hpZ < none), within {intra} (zeropp < FSDP2's)")
    kept = {k: r[4] for k, r in runs.items()}
    check(all_ok(kept["zeropp"] == kept["none"]), f"hpZ: nothing kept after the step (retained bytes {kept})")


def main():
    # A collective (or a sub-group's creation) that waits 5 minutes is a hang
    # to report, not to sit in until CI's limit.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    defect = defects.apply_from_env()
    ls = zt.local_size()
    topo = zt.Topology(dist.group.WORLD, ls)
    if dist.get_rank() == 0:
        print(f"{topo.world} ranks as {topo.nodes} nodes x {ls}; seeded defect: {defect}", flush=True)
    test_reduce_scatter(topo)
    test_all_gather(topo)
    test_partial_grads(ls)
    test_groups_reused(ls)
    test_replicate_errors(ls)
    counts = test_bytes(ls)
    test_hpz(ls)
    if dist.get_rank() == 0 and os.environ.get("ZEROPP_TORCH_OUT"):
        with open(os.environ["ZEROPP_TORCH_OUT"], "w") as f:
            json.dump({"bytes": counts, "failures": FAILURES}, f, indent=1)
    dist.destroy_process_group()
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
