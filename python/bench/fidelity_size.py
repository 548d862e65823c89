"""What qwZ and qgZ deliver against the exact collective of the same inputs,
per layer kind, for a Hugging Face Llama of one width (``cargo xtask bench
fidelity-size`` runs it at every width and draws the curve; CI runs the
largest for one step with bounds).

Under torchrun as 2 nodes x 2 (ZEROPP_LOCAL_SIZE=2), ``LlamaForCausalLM``
under FSDP2 (``fully_shard`` per decoder layer and at the root, bf16 mixed
precision) with ``zeropp.torch.enable``'s defaults trains ``--steps`` steps of
AdamW on tinyshakespeare's bytes (``ZEROPP_SHAKESPEARE``; random tokens
without it), one sequence of ``--tokens`` per rank. Each quantized collective
also runs exactly, on the side, from the same inputs:

- qgZ: every reduce-scatter's inputs are all-gathered and summed in float64
  (the exact sum or mean FSDP2 asked for), against the shard qgZ delivered;
- qwZ: every forward all-gather is rerun as torch's own all-gather of the
  same bf16 shards, against the weights qwZ delivered.

At ``--probe`` steps it reports, per layer kind (``q_proj``, ``mlp``'s
``gate_proj``, ``embed_tokens``, ...; the 1-D norms travel exactly and are
left out): the cosine similarity, the relative norm error ``|q - e| / |e|``
and, for gradients, the relative error of AdamW's update direction
``m / (sqrt(v) + eps)`` taken with the quantized gradient and with the exact
one, from moments kept over the exact gradients of every step. The last two
are also reported with each column of a linear layer's weight weighted by
its input channel's mean square over the step's tokens
(``act_rel_error``, ``act_update_rel_error``): a weight error in column j
moves the layer's output in proportion to that channel, so this weighs the
error as the loss's second-order term does (a few hidden channels of the
MLP's down projection carry most of that weight). Rank 0 writes
the JSON to ``--out``. With ``--grad-bounds``/``--weight-bounds LO,HI`` it
checks every kind's relative norm error at every probed step against the
bounds, and that it saw all nine kinds, and exits 1 with a ``FAIL`` line
when one is outside (the seeded defect ``qwz-int4``, INT4 weights in qwZ,
must cross the weights' bound).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import zeropp.torch as zt
from zeropp.torch import collectives
from zeropp.torch import kernels as K
from zeropp.torch.enable import _names, _param_group, _segments

from _llama import add_shape_args, build

# AdamW's defaults (torch.optim.AdamW): the update direction the probe compares.
BETAS, EPS = (0.9, 0.999), 1e-8


class Probe:
    """Accumulated sums per (collective, kind) at the current step, AdamW
    moments per (module, parameter) over the exact gradients."""

    def __init__(self, model: torch.nn.Module, world: int):
        self.model, self.world = model, world
        self.phase, self.step, self.record = "", 0, False
        self.sums: dict = {}
        self.moments: dict = {}
        self._kinds: dict | None = None
        self._names: dict = {}
        # Per linear layer's weight (by name): the mean square of each input
        # channel over the step's tokens, this rank's. A weight error in
        # column j moves the layer's output by that channel's activation, so
        # the loss's second-order sensitivity weighs column j by it.
        self.act: dict = {}
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(self._hook(name + ".weight"))

    def _hook(self, name: str):
        def hook(module, args):
            if self.record and self.phase == "forward":
                x = args[0].detach().to(torch.float64)
                self.act[name] = x.reshape(-1, x.shape[-1]).square().mean(0)
        return hook

    def names(self, segments) -> list:
        """The parameters' names of a chunk laid out as ``segments``."""
        self.kinds(segments)
        return self._names.get(tuple(segments or ()), [])

    def act_weights(self, name: str, n: int):
        """Each element's column weight in this rank's shard of ``name``
        (``n`` elements, whole rows under FSDP2's dim-0 sharding), or None."""
        h2 = self.act.get(name)
        if h2 is None or n % h2.numel() != 0:
            return None
        return h2.repeat(n // h2.numel())

    def kinds(self, segments) -> list:
        """The layer kind of each parameter of a chunk laid out as ``segments``
        (FSDP2 names its parameters at lazy init, before any collective)."""
        if self._kinds is None:
            self._kinds = {}
            for m in self.model.modules():
                if isinstance(m, FSDPModule) and (pg := _param_group(m)) is not None:
                    segs = tuple(_segments(pg, self.world))
                    self._kinds[segs] = [kind(n) for n in _names(pg)[1]]
                    self._names[segs] = list(_names(pg)[1])
        return self._kinds.get(tuple(segments or ()), [])

    def add(self, what: str, kind_: str, got: torch.Tensor, exact: torch.Tensor, extra=()):
        if not self.record:
            return
        s = self.sums.setdefault((what, kind_), np.zeros(13))
        g, e = got.double(), exact.double()
        s[:4] += [float(g @ e), float(g @ g), float(e @ e), float((g - e) @ (g - e))]
        for i, v in enumerate(extra):
            s[4 + i] += v


def maxima(x: torch.Tensor, g: int) -> tuple:
    """The sum of the squared group maxima of the ranks' own gradients
    (``[ranks, n]``, whole groups of ``g``), as they are and rotated: the
    measure of ``qgz_hadamard="auto"`` (INT4's noise power goes with it)."""
    whole = x.shape[1] // g * g
    if whole == 0:
        return 0.0, 0.0
    cols = x[:, :whole].to(torch.float32)
    rot = K.rotate(cols, group_size=g, seed=0, starts=[0] * x.shape[0])
    return tuple(float(t.reshape(x.shape[0], -1, g).abs().amax(-1).double().square().sum()) for t in (cols, rot))


def kind(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("weight", "bias") else parts[-1]


PROBE: Probe | None = None


def install():
    """Wraps both collectives' calls with their exact twins."""
    real_rs = collectives.QuantizedReduceScatter.__call__
    real_ag = collectives.QuantizedAllGather.__call__

    def rs(self, output_tensor, input_tensor, group, op, async_op=False):
        p = PROBE
        if p is None or p.phase != "backward" or group.size() == 1:
            return real_rs(self, output_tensor, input_tensor, group, op, async_op)
        # A copy (float32 holds a bf16 or float32 input exactly), taken before
        # qgZ runs; the sum is taken in float64.
        x = input_tensor.detach().reshape(-1).to(torch.float32, copy=True)
        sent = self._sent
        out = real_rs(self, output_tensor, input_tensor, group, op, async_op)
        w, c = group.size(), output_tensor.numel()
        # Every rank's chunk of this rank's shard: rows[k] is rank k's.
        rows = torch.empty_like(x)
        dist.all_to_all_single(rows, x, group=group)
        exact = rows.view(w, c).double().sum(0)
        mean, _, post = self._op(op)
        if mean:
            exact /= w
        if post is not None:
            exact *= post
        got = output_tensor.detach().reshape(-1).to(torch.float64)
        segs = self.segments or [(c, False)]
        kinds = p.kinds(self.segments) or ["chunk"] * len(segs)
        names = p.names(self.segments) or [""] * len(segs)
        carried = sent if sent is not None else (True,) * len(segs)
        at = 0
        for i, ((n, one_d), keep) in enumerate(zip(segs, carried)):
            if not keep:
                continue
            g, e = got[at:at + n], exact[at:at + n]
            at += n
            if one_d:
                continue
            key = (id(self), i)
            m, v = p.moments.get(key, (torch.zeros_like(e), torch.zeros_like(e)))
            t = p.step
            b1, b2 = BETAS

            def direction(grad):
                mm, vv = b1 * m + (1 - b1) * grad, b2 * v + (1 - b2) * grad * grad
                return (mm / (1 - b1 ** t)) / ((vv / (1 - b2 ** t)).sqrt() + EPS)

            du, de = direction(g), direction(e)
            # The ranks' own contributions, scaled as the result is: quantizing
            # each independently errs in proportion to their norm, not the sum's.
            own = rows.view(w, c)[:, at - n:at].double() * ((1.0 / w if mean else 1.0) * (post or 1.0))
            wt = p.act_weights(names[i], n) if i < len(names) else None
            wt = torch.ones_like(e) if wt is None else wt
            p.add("grad", kinds[i], g, e, (float((du - de) @ (du - de)), float(de @ de), float((own * own).sum()),
                                           *maxima(rows.view(w, c)[:, at - n:at], self.group_size),
                                           float(((g - e) ** 2) @ wt), float((e * e) @ wt),
                                           float(((du - de) ** 2) @ wt), float((de * de) @ wt)))
            p.moments[key] = (b1 * m + (1 - b1) * e, b2 * v + (1 - b2) * e * e)
        return out

    def ag(self, output_tensor, input_tensor, group, async_op=False):
        p = PROBE
        if p is None or p.phase != "forward" or not p.record:
            return real_ag(self, output_tensor, input_tensor, group, async_op)
        # FSDP2's input is a view of the output, which the gather overwrites.
        shard = input_tensor.detach().clone()
        out = real_ag(self, output_tensor, input_tensor, group, async_op)
        if out is not None and hasattr(out, "wait"):
            out.wait()
            out = None
        exact = torch.empty_like(output_tensor)
        dist.all_gather_into_tensor(exact, shard, group=group)
        w, n = group.size(), input_tensor.numel()
        got, ref = output_tensor.detach().view(w, n), exact.view(w, n)
        segs = self.segments or [(n, False)]
        kinds = p.kinds(self.segments) or ["chunk"] * len(segs)
        at = 0
        for i, (k, one_d) in enumerate(segs):
            if not one_d:
                # Every rank gathers the same weights: each counts 1/world of them.
                p.add("weight", kinds[i], got[:, at:at + k].reshape(-1) / w ** 0.5,
                      ref[:, at:at + k].reshape(-1) / w ** 0.5)
            at += k
        return out

    collectives.QuantizedReduceScatter.__call__ = rs
    collectives.QuantizedAllGather.__call__ = ag


def text() -> np.ndarray | None:
    """The bytes of the text ``ZEROPP_SHAKESPEARE`` names (tinyshakespeare in the bench), read once; None without it."""
    global _TEXT
    if _TEXT is None:
        path = os.environ.get("ZEROPP_SHAKESPEARE", "")
        _TEXT = np.frombuffer(open(path, "rb").read(), dtype=np.uint8) if path and os.path.exists(path) else False
    return _TEXT if _TEXT is not False else None


_TEXT = None


def data_source() -> str:
    """The text's file name (``ZEROPP_SHAKESPEARE`` may name any text), or random tokens."""
    return os.path.basename(os.environ["ZEROPP_SHAKESPEARE"]) if text() is not None else "random tokens"


def tokens(vocab: int, n: int, gen: torch.Generator) -> torch.Tensor:
    data = text()
    if data is not None:
        at = int(torch.randint(0, len(data) - n - 1, (1,), generator=gen))
        return torch.from_numpy(data[at:at + n].astype(np.int64) % vocab).view(1, n)
    return torch.randint(0, vocab, (1, n), generator=gen)


def main():
    global PROBE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    add_shape_args(ap, vocab=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--probe", default="1,10,last", help="steps to report, 1-based; last is --steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grad-bounds", default=None, metavar="LO,HI",
                    help="every kind's relative gradient error at every probed step must lie in [LO, HI]")
    ap.add_argument("--weight-bounds", default=None, metavar="LO,HI", help="the same for qwZ's weights")
    ap.add_argument("--group-size", type=int, default=256, help="qwZ's and qgZ's group (a candidate default)")
    ap.add_argument("--qgz-rotation", choices=["default", "on", "off", "down", "auto"], default="default",
                    help="qgZ's Hadamard rotation of each group: enable()'s default, forced on or off, "
                         "on for the MLP's down projections only, or chosen from the gradients (auto)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import defects

    defect = defects.apply_from_env()
    install()
    dist.init_process_group("gloo")
    ls, w = zt.local_size(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build(args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # "default" leaves the keyword to enable().
    rotation = {"default": {}, "on": {"qgz_hadamard": True}, "off": {"qgz_hadamard": False},
                "down": {"qgz_hadamard": lambda name: name.endswith("mlp.down_proj.weight")},
                "auto": {"qgz_hadamard": "auto"}}[args.qgz_rotation]
    summary_of = zt.enable(model, local_size=ls, seed=args.seed, group_size=args.group_size, **rotation)
    PROBE = Probe(model, w)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 * args.seed + 1 + dist.get_rank())
    probe_at = {args.steps if s == "last" else int(s) for s in args.probe.split(",")}
    report = {}
    for step in range(1, args.steps + 1):
        PROBE.step, PROBE.record, PROBE.sums = step, step in probe_at, {}
        x = tokens(args.vocab, args.tokens, gen)
        PROBE.phase = "forward"
        loss = model(input_ids=x, labels=x).loss
        PROBE.phase = "backward"
        loss.backward()
        PROBE.phase = ""
        opt.step()
        opt.zero_grad()
        if step in probe_at:
            keys = sorted(PROBE.sums)
            flat = torch.tensor(np.array([PROBE.sums[k] for k in keys]), dtype=torch.float64)
            # Every rank holds the same kinds (all layers are alike), in the same order.
            dist.all_reduce(flat)
            report[step] = {f"{what}/{k}": summary(what, s.numpy()) for (what, k), s in zip(keys, flat)}
    params = sum(p.numel() for p in model.parameters())
    worst = {"grad": 0.0, "weight": 0.0}
    least = {"grad": float("inf"), "weight": float("inf")}
    for per in report.values():
        for key, r in per.items():
            what = key.split("/")[0]
            worst[what] = max(worst[what], r["rel_norm_error"])
            least[what] = min(least[what], r["rel_norm_error"])
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"params": params, "hidden": args.hidden, "layers": args.layers, "steps": args.steps,
                       "group_size": args.group_size, "qgz_rotation": summary_of["qgz_rotation"],
                       # What rotated at the end: an explicit choice, or the automatic one's last.
                       "qgz_rotated": zt.rotated(model),
                       "data": data_source(),
                       "seeded_defect": os.environ.get("ZEROPP_SEEDED_DEFECT") if defect else None,
                       "probes": report, "worst": worst}, f, indent=1)
        print(f"{params} parameters ({data_source()}): worst relative error, gradients {worst['grad']:.4f}, "
              f"weights {worst['weight']:.4f}", flush=True)
    failed = False
    for what, bounds in (("grad", args.grad_bounds), ("weight", args.weight_bounds)):
        if bounds is None:
            continue
        lo, hi = (float(b) for b in bounds.split(","))
        kinds = [sum(k.startswith(what + "/") for k in per) for per in report.values()]
        # Every projection of the layers and the root's embedding and head at every
        # probed step: a probe that saw fewer did not see the collective it checks.
        if len(report) != len(probe_at) or min(kinds, default=0) < 9 or \
                not (lo <= least[what] and worst[what] <= hi):
            failed = True
            if dist.get_rank() == 0:
                print(f"FAIL {what}: relative errors {least[what]:.4f} to {worst[what]:.4f}, "
                      f"{min(kinds, default=0)} kinds at a probed step, {len(report)} steps; bounds [{lo}, {hi}]",
                      flush=True)
    zt.release()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def summary(what: str, s: np.ndarray) -> dict:
    dot, gg, ee, dd, udd, uee, oo, raw, rotated, wdd, wee, wudd, wuee = s
    r = {"cosine": dot / max(np.sqrt(gg * ee), 1e-300), "rel_norm_error": np.sqrt(dd / max(ee, 1e-300))}
    if what == "grad":
        r["update_rel_error"] = np.sqrt(udd / max(uee, 1e-300))
        # sqrt(sum over ranks |x_k|^2) / |sum|: how far the ranks' gradients
        # cancel. INT4's error on each rank's own is rel_norm_error / this.
        r["rank_spread"] = np.sqrt(oo / max(ee, 1e-300))
        # The automatic rotation's measure: the rotated groups' squared maxima
        # over the raw ones (it rotates below 0.5).
        r["rotation_measure"] = rotated / max(raw, 1e-300)
        # The same errors with each column weighted by its input channel's
        # mean square (the loss's second-order sensitivity to a weight error
        # there; 1-D parameters and embeddings unweighted).
        r["act_rel_error"] = np.sqrt(wdd / max(wee, 1e-300))
        r["act_update_rel_error"] = np.sqrt(wudd / max(wuee, 1e-300))
    return {k: float(v) for k, v in r.items()}


if __name__ == "__main__":
    main()
