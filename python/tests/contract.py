"""FSDP2's contract under zeropp.torch at a fault (issue 37's tests 1-5).

Run with 4 processes posing as 2 nodes x 2 ranks, gloo on localhost, once per
kernel path (``cargo xtask test-torch`` runs both):

    ZEROPP_LOCAL_SIZE=2 torchrun --nproc-per-node 4 python/tests/contract.py
    ZEROPP_TORCH_KERNELS=torch ZEROPP_LOCAL_SIZE=2 torchrun --nproc-per-node 4 python/tests/contract.py

The process group has a 60 s timeout, so a hang is a failure, not a stuck CI.

1. **A non-finite gradient on one rank.** An inf is injected into rank 1's
   gradient at step 1 (through a hook on an activation's gradient), under
   FSDP2's default, under zeropp (qwZ + qgZ + hpZ) and under zeropp's HSDP
   take-over (2 x 2, a replica per node). Every rank must return from every
   step, every rank must see a non-finite ``clip_grad_norm_`` at step 1 and a
   finite one at the other steps (FSDP2's default does), the script skips
   that step (the parameters must be bit-identical across it), and training
   goes on. A non-finite *weight* in one rank's shard (qwZ) must reach every
   rank's loss as NaN, without an exception.
2. **fp16 with GradScaler.** ``MixedPrecisionPolicy(param_dtype=float16)``
   and ``torch.amp.GradScaler`` whose first scale overflows: zeropp skips the
   same steps as FSDP2's default and then trains; its final loss (mean of the
   last 5 steps) is within 3% of the default's.
3. **No host synchronisation inside a collective** on the torch-op path
   (always checked with ``ZEROPP_TORCH_KERNELS=torch``): ``Tensor.item``,
   ``__bool__``, ``tolist``, ``__float__`` and ``__int__`` are recorded
   whenever called while one of zeropp's collectives runs, through a training
   step of every variant (the step with an inf included; the default rotation,
   ``"auto"``, whose choice must reach the host without one, and the recipe
   unrotated); none may be.
4. **The state kept between steps** (``zeropp.torch.retained_bytes``) stays
   at most 5% of the rank's parameter shard, on a model of 1.6M parameters.
   The index tensors the collectives used to keep cost 16 bytes per chunk
   element, 4x the shard.
5. **Options that cannot act are errors**, each with its message:
   ``qgz_two_level``/``qgz_hadamard`` with ``qgz=False`` and under the HSDP
   take-over inside a node; a Hadamard group above 8192 in ``enable``,
   ``QuantizedReduceScatter``, the torch-op stages and the Rust stages; a
   ``qgz_hadamard`` function that chooses no parameter, or one (or an
   explicit ``"auto"``) given with ``exclude_1d=False``; the default rotation
   there is off, not an error.
6. **qgZ's rotation.** ``enable(qgz_hadamard=True)`` rotates qgZ's groups
   wherever qgZ quantizes (the block), but not in the module that holds the
   embeddings, whether their rows are whole groups (width 256 against groups
   of 256) or not (128); and the embedding rows of tokens no rank saw get a
   gradient of exactly zero: a Hadamard group spanning a seen row and an
   unseen one would spread noise onto the unseen.
   **6b.** ``qgz_hadamard`` as a function of a parameter's name rotates that
   parameter's groups only: the other gradients are bit for bit the
   unrotated run's, the chosen one within 0.3 of the exact gradient.
   **6c.** The default, ``qgz_hadamard="auto"``, chooses from the gradients:
   the one parameter whose gradient has outlier columns on one rank, on every
   rank, bit for bit as if chosen by name, and the same while the choice is
   still on the device.

Exit status 0 when all pass (``ZEROPP_CONTRACT_TESTS=2,3`` runs some). With ``ZEROPP_SEEDED_DEFECT`` (``defects.py``) it
must fail: ``nonfinite-raises`` (the old check: quantizing a non-finite value
raises) fails tests 1 and 2, ``host-sync`` (a host-side finiteness check in
the torch-op quantizer) fails test 3, ``index-plan`` (the old per-element
index tensors) fails test 4, ``rotation-spans-rows`` (the embeddings' module
rotated too) and ``rotation-whole-rows`` (rotated where its rows are whole
groups) fail test 6, ``rotation-wrong-inverse`` (a per-parameter rotation
undone with rank 0's signs on every rank) test 6b, ``auto-rank-local`` (each
rank chooses from its own gradient) and ``auto-device-flags-ignored`` (a
choice on the device rotates every candidate) test 6c.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import defects  # noqa: E402
import gpt  # noqa: E402
import zeropp  # noqa: E402
import zeropp.torch as zt  # noqa: E402
from zeropp import _zeropp  # noqa: E402
from zeropp.torch import allreduce, collectives  # noqa: E402
from zeropp.torch.stages import TorchQgzStages  # noqa: E402

FAILURES: list[str] = []
HIT_RANK, HIT_STEP, STEPS = 1, 1, 4


def check(ok: bool, what: str):
    """Records a verdict; the outcome is every rank's (a failure anywhere fails)."""
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t)
    ok = int(t.item()) == 0
    if not ok:
        FAILURES.append(what)
    if dist.get_rank() == 0:
        print(("ok   " if ok else "FAIL ") + what, flush=True)


def fatal(what: str):
    """A rank whose step raised: the run cannot go on (its peers wait in a
    collective), so say why and leave at once; the peers fail on the closed
    connection or the 60 s timeout, each with its own FAIL line."""
    print(f"FAIL rank {dist.get_rank()}: {what}", flush=True)
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)


def _hsdp_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))


def build(variant: str, ls: int, cfg: gpt.Config, mp=None, seed: int = 0):
    """The small GPT under ``variant``: ``default`` (FSDP2's collectives),
    ``zeropp`` (qwZ + qgZ + hpZ) or ``hsdp`` (zeropp's take-over of HSDP's
    replica all-reduce, a replica per node)."""
    torch.manual_seed(seed)
    model = gpt.GPT(cfg)
    kw = {} if mp is None else {"mp_policy": mp}
    mesh = _hsdp_mesh() if variant == "hsdp" else None
    if mesh is not None:
        kw["mesh"] = mesh["shard"]
    reshard = ls if variant.startswith("zeropp") else True
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    if variant == "zeropp":
        zt.enable(model, local_size=ls)
    elif variant == "zeropp-unrotated":
        zt.enable(model, local_size=ls, qgz_hadamard=False)
    elif variant == "hsdp":
        zt.enable(model, local_size=ls, replicate=mesh["replicate"])
    return model


def inject_inf(model, step_of):
    """From now on, rank HIT_RANK's gradient of block 0's MLP activation gets
    an inf at step HIT_STEP (``step_of()`` says the step)."""
    def fwd(m, inp, out):
        if dist.get_rank() == HIT_RANK and step_of() == HIT_STEP:
            def bad(g):
                g = g.clone()
                g.view(-1)[0] = float("inf")
                return g
            out.register_hook(bad)
        return out
    model.blocks[0].fc.register_forward_hook(fwd)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _norm_value(norm) -> torch.Tensor:
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def train_with_fault(variant: str, ls: int):
    """Steps of ``variant`` with the inf injected; per step: whether the norm
    was finite, and whether the parameters came through a skipped step
    unchanged."""
    cfg = gpt.Config(d=64, layers=2, heads=4, seq=32)
    model = build(variant, ls, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"step": -1}
    inject_inf(model, lambda: state["step"])
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    finite, unchanged = [], True
    for step in range(STEPS):
        state["step"] = step
        x = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=gen)
        before = [_local(p).detach().clone() for p in model.parameters()]
        try:
            model(x, x).backward()
            norm = _norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        except Exception as e:  # noqa: BLE001 - any exception on one rank breaks the contract
            fatal(f"test 1 ({variant}): step {step} raised {type(e).__name__}: {e}")
        ok = bool(torch.isfinite(norm))
        finite.append(ok)
        if ok:
            opt.step()
        opt.zero_grad()
        if not ok:
            unchanged &= all(torch.equal(a, _local(p).detach()) for a, p in zip(before, model.parameters()))
    return finite, unchanged, model


def gather_list(v):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, v)
    return out


def test_nonfinite_gradient(ls: int):
    want = [step != HIT_STEP for step in range(STEPS)]
    variants = ["default", "zeropp"] + (["hsdp"] if dist.get_world_size() == 4 and ls == 2 else [])
    for variant in variants:
        finite, unchanged, _ = train_with_fault(variant, ls)
        every = gather_list(finite)
        check(all(f == want for f in every),
              f"test 1 ({variant}): every rank returned from every step, and sees the inf of rank {HIT_RANK} "
              f"at step {HIT_STEP} as a non-finite gradient norm, the other steps finite (norms finite per "
              f"rank and step: {every})")
        check(all(gather_list(unchanged)), f"test 1 ({variant}): the script skipped step {HIT_STEP} on every "
              f"rank (parameters bit-identical across it)")


def test_nonfinite_weight(ls: int):
    """qwZ: rank 1's shard of one weight holds an inf; every rank's loss is NaN."""
    cfg = gpt.Config(d=64, layers=2, heads=4, seq=32)
    model = build("zeropp", ls, cfg)
    if dist.get_rank() == HIT_RANK:
        with torch.no_grad():
            _local(model.blocks[1].fc.weight).view(-1)[3] = float("inf")
    x = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            loss = model(x, x)
    except Exception as e:  # noqa: BLE001
        fatal(f"test 1 (weight): the forward raised {type(e).__name__}: {e}")
    every = gather_list(bool(torch.isfinite(loss)))
    check(not any(every), f"test 1 (weight): an inf in rank {HIT_RANK}'s weight shard reaches every rank's loss "
          f"through qwZ as a non-finite value (finite per rank: {every})")


def train_fp16(variant: str, ls: int, steps: int):
    """fp16 mixed precision with a GradScaler whose first scale overflows."""
    cfg = gpt.Config(d=64, layers=2, heads=4, seq=32)
    mp = MixedPrecisionPolicy(param_dtype=torch.float16)
    model = build(variant, ls, cfg, mp=mp, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # 2^40 overflows fp16 (max 65504) at once; each skip divides it by 2^8, so
    # the steps skipped are few and the last overflowing scale is far from the edge.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, backoff_factor=2.0 ** -8, growth_interval=10_000)
    corpus_gen = torch.Generator().manual_seed(7 + dist.get_rank())
    skipped, losses = [], []
    for step in range(steps):
        x = torch.randint(0, cfg.vocab, (8, cfg.seq), generator=corpus_gen)
        try:
            loss = model(x, x)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
        except Exception as e:  # noqa: BLE001
            fatal(f"test 2 ({variant}): step {step} raised {type(e).__name__}: {e}")
        opt.zero_grad()
        skipped.append(scaler.get_scale() < scale)
        losses.append(float(loss))
    return skipped, losses


def test_fp16_grad_scaler(ls: int):
    steps = 24
    base_skip, base_loss = train_fp16("default", ls, steps)
    zpp_skip, zpp_loss = train_fp16("zeropp", ls, steps)
    agree = all(s == base_skip for s in gather_list(zpp_skip) + gather_list(base_skip))
    check(agree and any(base_skip) and not all(base_skip),
          f"test 2: fp16 + GradScaler: zeropp skips the steps FSDP2's default skips (default "
          f"{[i for i, s in enumerate(base_skip) if s]}, zeropp {[i for i, s in enumerate(zpp_skip) if s]}) and "
          f"then trains")
    tail = lambda v: sum(v[-5:]) / 5  # noqa: E731
    ratio = tail(zpp_loss) / tail(base_loss)
    check(math.isfinite(ratio) and abs(ratio - 1) <= 0.03,
          f"test 2: final loss zeropp / default = {ratio:.4f} (within 3%; default {tail(base_loss):.4f})")


class HostSyncGuard:
    """Records every ``Tensor.item``, ``__bool__``, ``tolist``, ``__float__``
    and ``__int__`` called while one of zeropp's collectives runs."""

    NAMES = ("item", "__bool__", "tolist", "__float__", "__int__")

    def __init__(self):
        self.inside = 0
        self.seen: list[str] = []
        self._saved = {}

    def __enter__(self):
        guard = self
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)
            self._saved[("t", name)] = real

            def wrapped(t, *a, _real=real, _name=name, **k):
                if guard.inside:
                    frame = traceback.extract_stack(limit=3)[0]
                    guard.seen.append(f"Tensor.{_name} at {os.path.basename(frame.filename)}:{frame.lineno}")
                return _real(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        for cls in (collectives.QuantizedAllGather, collectives.QuantizedReduceScatter, allreduce.QuantizedAllReduce):
            real = cls.__call__
            self._saved[(cls, "__call__")] = real

            def call(obj, *a, _real=real, **k):
                guard.inside += 1
                try:
                    return _real(obj, *a, **k)
                finally:
                    guard.inside -= 1

            cls.__call__ = call
        return self

    def __exit__(self, *exc):
        for (owner, name), real in self._saved.items():
            setattr(torch.Tensor if owner == "t" else owner, name, real)
        return False


@contextlib.contextmanager
def kernels(mode: str):
    old = os.environ.get("ZEROPP_TORCH_KERNELS")
    os.environ["ZEROPP_TORCH_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ZEROPP_TORCH_KERNELS", None)
        else:
            os.environ["ZEROPP_TORCH_KERNELS"] = old


def test_no_host_sync(ls: int):
    # zeropp's default rotation ("auto") must reach its choice without a sync; zeropp-unrotated is
    # the recipe with qgz_hadamard=False.
    variants = ["zeropp", "zeropp-unrotated"] + (["hsdp"] if dist.get_world_size() == 4 and ls == 2 else [])
    with kernels("torch"):
        for variant in variants:
            with HostSyncGuard() as guard:
                train_with_fault(variant, ls)
            seen = sorted(set(guard.seen))
            check(not seen, f"test 3 ({variant}, torch-op kernels): no host synchronisation inside a collective "
                  f"through {STEPS} steps with an inf ({len(guard.seen)} seen{': ' + ', '.join(seen[:4]) if seen else ''})")


def test_retained_state(ls: int):
    cfg = gpt.Config(d=256, layers=2, heads=4, seq=32)
    model = build("zeropp", ls, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        x = torch.randint(0, cfg.vocab, (2, cfg.seq), generator=gen)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    shard = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    kept = zt.retained_bytes(model)
    frac = kept / shard
    params = sum(p.numel() for p in model.parameters())
    check(frac <= 0.05 and kept > 0,
          f"test 4: zeropp keeps {kept} B between steps, {frac:.5f} of the rank's {shard} B parameter shard "
          f"({params / 1e6:.2f}M parameters; bound 0.05; kernels {zeropp.torch.kernels.mode()})")


def _raises(fn, *words) -> str | None:
    """None when ``fn()`` raises a ZeroppError whose message holds every word;
    else what happened."""
    try:
        fn()
    except _zeropp.ZeroppError as e:
        missing = [w for w in words if w not in str(e)]
        return None if not missing else f"message {str(e)!r} lacks {missing}"
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {e}"
    return "did not raise"


def test_refusals(ls: int):
    cfg = gpt.Config(d=32, layers=1, heads=2, seq=16)
    results = {}

    def fresh(variant="plain"):
        torch.manual_seed(0)
        model = gpt.GPT(cfg)
        kw = {}
        mesh = None
        if variant == "hsdp":
            mesh = _hsdp_mesh()
            kw["mesh"] = mesh["shard"]
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        return model, mesh

    m, _ = fresh()
    results["qgz=False with qgz_two_level"] = _raises(
        lambda: zt.enable(m, local_size=ls, qgz=False, qgz_two_level=True), "qgz=False")
    results["qgz=False with qgz_hadamard"] = _raises(
        lambda: zt.enable(m, local_size=ls, qgz=False, qgz_hadamard=True), "qgz=False")
    results["enable: Hadamard group 16384"] = _raises(
        lambda: zt.enable(m, local_size=ls, qgz_hadamard=True, group_size=16384), "at most 8192", "16384")
    topo = zt.Topology(dist.group.WORLD, ls)
    results["QuantizedReduceScatter: Hadamard group 16384"] = _raises(
        lambda: zt.QuantizedReduceScatter(topo, hadamard=True, group_size=16384), "at most 8192")
    results["torch-op stages: Hadamard group 16384"] = _raises(
        lambda: TorchQgzStages(4, 2, 0, 100, group_size=16384, hadamard=1), "at most 8192")
    results["Rust stages: Hadamard group 16384"] = _raises(
        lambda: _zeropp.QgzStages(4, 2, 0, 100, group_size=16384, hadamard=1), "8192")
    if dist.get_world_size() > ls:
        m, _ = fresh()
        results["qgz_hadamard choosing no parameter"] = _raises(
            lambda: zt.enable(m, local_size=ls, qgz_hadamard=lambda name: name.endswith("fc3.weight")),
            "chose none of the", "'blocks.0.qkv.weight'")
        results["qgz_hadamard=\"auto\" with exclude_1d=False"] = _raises(
            lambda: zt.enable(m, local_size=ls, exclude_1d=False, qgz_hadamard="auto"), "exclude_1d=False")
        results["qgz_hadamard by name with exclude_1d=False"] = _raises(
            lambda: zt.enable(m, local_size=ls, exclude_1d=False, qgz_hadamard=lambda name: True),
            "exclude_1d")
    if dist.get_world_size() == 4 and ls == 2:
        for opt in ("qgz_two_level", "qgz_hadamard"):
            hm, mesh = fresh("hsdp")
            results[f"HSDP take-over inside a node with {opt}"] = _raises(
                lambda: zt.enable(hm, local_size=ls, replicate=mesh["replicate"], **{opt: True}),
                "cannot act here", "inside one node", "QuantizedAllReduce")
    for what, bad in results.items():
        check(bad is None, f"test 5: refused with its reason: {what}" + (f" ({bad})" if bad else ""))
    # The default rotation ("auto" where it can act) is off, not an error,
    # where an explicit choice is refused.
    quiet = [("exclude_1d=False", "plain", {"exclude_1d": False}), ("qgz=False", "plain", {"qgz": False}),
             ("group_size=96", "plain", {"group_size": 96})]
    if dist.get_world_size() == 4 and ls == 2:
        quiet.append(("the HSDP take-over inside a node", "hsdp", None))
    for what, variant, kw in quiet:
        m, mesh = fresh(variant)
        try:
            modes = zt.enable(m, local_size=ls, **(kw or {"replicate": mesh["replicate"]}))["qgz_rotation"]
            bad = None if "auto" not in modes and True not in modes else f"qgz_rotation {modes}"
        except Exception as e:  # noqa: BLE001 -- the refusal is the failure this checks for
            bad = f"{type(e).__name__}: {e}"
        check(bad is None, f"test 5: the default rotation is off with {what}" + (f" ({bad})" if bad else ""))


def test_rotation(ls: int):
    """6. qgZ's rotation (``qgz_hadamard=True``) acts wherever qgZ quantizes
    but never in a module holding an embedding: at width 256 (a token row is
    one group of 256) the root stays unrotated, and at width 128 (two rows a
    group) the rows of the tokens no rank saw get a gradient of exactly zero."""
    nodes = dist.get_world_size() // ls

    def rotation(cfg: gpt.Config):
        model = build("default", ls, cfg)
        kw = {"qgz_hadamard": True} if nodes > 1 else {}
        return model, zt.enable(model, local_size=ls, **kw)["qgz_rotation"]

    # The root holds the embeddings and the head; the block is rotated. Inside
    # one node nothing is quantized.
    want = [False, True] if nodes > 1 else [False, False]
    _, wide = rotation(gpt.Config(d=256, layers=1, heads=2, seq=16))
    check(wide == want, f"test 6: qgZ's rotation at width 256, per module {wide} (want {want})")
    cfg = gpt.Config(d=128, layers=1, heads=2, seq=16)
    model, narrow = rotation(cfg)
    check(narrow == want, f"test 6: qgZ's rotation at width 128, per module {narrow} (want {want})")
    # Even token ids only: every group of 256 would hold a seen row and an unseen one.
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = 2 * torch.randint(0, cfg.vocab // 2, (4, cfg.seq), generator=gen)
    y = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=gen)
    model(x, y).backward()
    g = model.tok.weight.grad.full_tensor()
    unseen, seen = float(g[1::2].abs().max()), float(g[0::2].abs().max())
    check(unseen == 0.0 and seen > 0.0,
          f"test 6: the embedding's unseen rows get no gradient through qgZ (largest {unseen:.3g}; "
          f"seen rows' {seen:.3g})")


def _rotation_case(ls: int):
    """Tests 6b and 6c's setting: the one-block GPT at width 128, this rank's
    batch, and the parameter they rotate; None inside one node (nothing is
    quantized there)."""
    if dist.get_world_size() // ls == 1:
        return None
    cfg = gpt.Config(d=128, layers=1, heads=2, seq=16)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=gen)
    y = torch.randint(0, cfg.vocab, (4, cfg.seq), generator=gen)
    return cfg, x, y, "blocks.0.out.weight"


def test_rotation_by_name(ls: int):
    """6b. ``qgz_hadamard`` as a function of a parameter's name rotates the
    chosen parameters only: every other gradient is bit for bit the unrotated
    run's, and the chosen one differs from it and stays as close to FSDP2's
    exact gradient as INT4 allows."""
    case = _rotation_case(ls)
    if case is None:
        return
    cfg, x, y, chosen = case
    grads, rotated = {}, None
    for how in ("exact", "unrotated", "by name"):
        model = build("default", ls, cfg)
        if how == "unrotated":
            zt.enable(model, local_size=ls, qgz_hadamard=False)
        elif how == "by name":
            rotated = zt.enable(model, local_size=ls, qgz_hadamard=lambda n: n == chosen)["qgz_rotated"]
        model(x, y).backward()
        grads[how] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    check(rotated == [chosen], f"test 6b: the parameters rotated by name: {rotated} (want [{chosen!r}])")
    same = [n for n in grads["exact"] if n != chosen and torch.equal(grads["by name"][n], grads["unrotated"][n])]
    check(len(same) == len(grads["exact"]) - 1,
          f"test 6b: the parameters not chosen are reduced as unrotated, bit for bit "
          f"({len(same)} of {len(grads['exact']) - 1})")
    exact = grads["exact"][chosen]
    err = {h: float((grads[h][chosen] - exact).norm() / exact.norm()) for h in ("unrotated", "by name")}
    check(not torch.equal(grads["by name"][chosen], grads["unrotated"][chosen]) and err["by name"] < 0.3,
          f"test 6b: {chosen}, rotated, against the exact gradient: relative error {err['by name']:.3f} "
          f"(unrotated {err['unrotated']:.3f}; bound 0.3)")


def test_rotation_auto(ls: int):
    """6c. The default rotation (``"auto"``) chooses from the gradients: where
    rank 0's input to ``blocks.0.out`` carries four outlier channels (x 64),
    every rank rotates that parameter's groups and no other, and the
    gradients are bit for bit those of the same parameter chosen by name.
    A choice still on the device (its copy to the host not arrived, as on a
    GPU) rotates the same, bit for bit."""
    from zeropp.torch import rotation

    case = _rotation_case(ls)
    if case is None:
        return
    cfg, x, y, chosen = case
    scale = torch.ones(4 * cfg.d)
    scale[:4] = 64.0
    grads, picked = {}, {}
    settle = rotation.AutoRotation.settle
    for how in ("by name", "auto", "auto, on the device"):
        model = build("default", ls, cfg)
        if dist.get_rank() == 0:
            model.blocks[0].out.register_forward_pre_hook(lambda m, a: (a[0] * scale,))
        kw = {"qgz_hadamard": lambda n: n == chosen} if how == "by name" else {}
        modes = zt.enable(model, local_size=ls, **kw)["qgz_rotation"]
        if how == "auto, on the device":
            # The host never takes the measured choice in: it stays on the device.
            rotation.AutoRotation.settle = lambda self: self._pending is None
        try:
            model(x, y).backward()
        finally:
            rotation.AutoRotation.settle = settle
        grads[how] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        picked[how] = gather_list(zt.rotated(model))
    check(modes == [False, "auto"], f"test 6c: qgz_rotation per module {modes} (want [False, 'auto'])")
    check(all(p == [chosen] for p in picked["auto"]),
          f"test 6c: the parameters the automatic rotation chose, per rank: {picked['auto']} (want [{chosen!r}])")
    for how in ("auto", "auto, on the device"):
        same = [n for n in grads["by name"] if torch.equal(grads[how][n], grads["by name"][n])]
        check(len(same) == len(grads["by name"]),
              f"test 6c: {how}: the gradients are those of {chosen} rotated by name, bit for bit "
              f"({len(same)} of {len(grads['by name'])})")


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    defect = defects.apply_from_env()
    ls = zt.local_size()
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, kernels {zeropp.torch.kernels.mode()}, {dist.get_world_size()} ranks, "
              f"{ls} per node{', seeded defect ' + os.environ['ZEROPP_SEEDED_DEFECT'] if defect else ''}",
              flush=True)
    tests = {"1": (test_nonfinite_gradient, test_nonfinite_weight), "2": (test_fp16_grad_scaler,),
             "3": (test_no_host_sync,), "4": (test_retained_state,), "5": (test_refusals,),
             "6": (test_rotation, test_rotation_by_name, test_rotation_auto)}
    chosen = [t for t in os.environ.get("ZEROPP_CONTRACT_TESTS", "1,2,3,4,5,6").split(",") if t]
    for t in chosen:
        if t not in tests:
            raise SystemExit(f"ZEROPP_CONTRACT_TESTS: no test {t!r} (1-6)")
        for fn in tests[t]:
            fn(ls)
    ok = not FAILURES
    if dist.get_rank() == 0:
        print(f"contract: {'all pass' if ok else f'{len(FAILURES)} FAILED'}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
