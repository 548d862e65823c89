""":func:`enable`: qwZ and qgZ on every FSDP2 module of a model."""

from __future__ import annotations

import torch

import weakref

from .. import _zeropp
from .allreduce import QuantizedAllReduce
from .collectives import QuantizedAllGather, QuantizedReduceScatter, _Shared
from .rotation import AutoRotation
from .stages import check_hadamard_group, hadamard_group_fits
from .topology import _shard_groups, shared_topology
from .topology import local_size as _env_local_size

# The collectives enable() installed, per model (what retained_bytes() counts).
_INSTALLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def retained_bytes(model: torch.nn.Module) -> int:
    """Bytes zeropp.torch keeps between steps for ``model``: every tensor
    the collectives that :func:`enable` installed on it still hold after a
    call returns, and their segment tables. By design it is a few KiB (the
    tables; the work buffers live for one call): ``python/tests/contract.py``
    bounds it at 5% of the rank's parameter shard, and FSDP2's own memory
    is measured beside it in ``cargo xtask bench torch-scale``."""
    return sum(c.retained_bytes() for c in _INSTALLED.get(model, []))


def rotated(model: torch.nn.Module) -> list:
    """The parameters whose groups qgZ rotates now: those an explicit
    ``qgz_hadamard`` chose, and those the automatic rotation
    (``qgz_hadamard="auto"``) chose at its last measure, by FSDP2's names.
    Empty before the first backward where the choice is automatic.

    >>> import torch, zeropp.torch as zt
    >>> zt.rotated(torch.nn.Linear(2, 2))   # no enable(): nothing rotates
    []
    """
    names = []
    for c in _INSTALLED.get(model, []):
        if isinstance(c, QuantizedReduceScatter):
            own = c.names() if callable(c.names) else (c.names or [])
            # A whole-chunk rotation without a layout rotates every parameter.
            flags = c.rotate_params or ([c.hadamard and not one_d for _, one_d in c.segments]
                                        if c.segments else [c.hadamard] * len(own))
            names += [n for n, f in zip(own, flags) if f]
    return names


def _param_group(module):
    state = module._get_fsdp_state()
    return getattr(state, "_fsdp_param_group", None)


def _segments(param_group, world: int):
    """The per-rank chunk layout of a module's collectives: one (elements,
    is_1d) per parameter of ``param_group.fsdp_params``, in FSDP2's order (dim 0
    padded to a multiple of the world, then split)."""
    segs = []
    for fp in param_group.fsdp_params:
        size = getattr(fp, "_orig_size", None)
        if size is None:
            raise _zeropp.ZeroppError(
                f"zeropp.torch reads FSDP2's parameter layout (FSDPParam._orig_size), which this torch "
                f"({torch.__version__}) does not have; the tested releases are 2.9.0 and 2.15.0"
            )
        rows = -(-size[0] // world) if len(size) else 1
        rest = 1
        for d in size[1:]:
            rest *= d
        segs.append((rows * rest, len(size) == 1))
    return segs


def _holds_embedding(param_group) -> bool:
    """Whether ``param_group`` holds an embedding (``nn.Embedding``,
    ``nn.EmbeddingBag``) or a weight tied to one (an LM head); qgZ's rotation
    leaves such a module alone. An embedding's gradient is zero on every row
    whose token the batch did not hold, and a rotated group spanning such a
    row and a seen one spreads the seen row's rounding onto it, which AdamW
    turns into a full step of noise (the HF Llama at width 128, groups of 256:
    the embedding's update error 0.505 against 0.045 unrotated). Where a row
    is a whole number of groups no group spans two, but rotating the module
    (the embeddings and the head, FSDP2's root) still cost the validation loss
    on Python source text: 1.0097 against FSDP2 at 4.37M parameters, 1.0024
    with the root left unrotated."""
    embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    for fp in param_group.fsdp_params:
        info = getattr(fp, "_module_info", None)
        owners = [getattr(info, "module", None), *(getattr(info, "shared_modules", None) or [])]
        if any(isinstance(m, embeddings) for m in owners):
            return True
    return False


def _param_names(param_group, module_names: dict) -> list:
    """The parameters' names from the model's root (``module_names``: ``id`` of
    a submodule to its name), known at :func:`enable` time."""
    names = []
    for i, fp in enumerate(param_group.fsdp_params):
        info = getattr(fp, "_module_info", None)
        owner = module_names.get(id(getattr(info, "module", None)))
        leaf = getattr(info, "param_name", None)
        names.append(f"#{i}" if owner is None or leaf is None else ".".join(x for x in (owner, leaf) if x))
    return names


def _check_pick(model, pick, module_names: dict, fsdp_module):
    """Refuses a ``qgz_hadamard`` function that chooses no parameter qgZ could
    rotate (a misspelt name would otherwise leave the rotation silently off)."""
    candidates = []
    for module in model.modules():
        pg = _param_group(module) if isinstance(module, fsdp_module) else None
        if pg is None or _holds_embedding(pg):
            continue
        sizes = [getattr(fp, "_orig_size", ()) for fp in pg.fsdp_params]
        candidates += [n for n, size in zip(_param_names(pg, module_names), sizes) if len(size) >= 2]
    if not any(pick(n) for n in candidates):
        shown = ", ".join(repr(n) for n in candidates[:3]) + (", ..." if len(candidates) > 3 else "")
        raise _zeropp.ZeroppError(
            f"zeropp.torch.enable: qgz_hadamard's function chose none of the {len(candidates)} parameters "
            f"qgZ could rotate ({shown or 'none'}; a module holding an embedding is never rotated)")


def _names(param_group):
    """The module's name and its parameters' (FSDP2 sets them at its lazy
    init, so they are read when needed)."""
    module = getattr(param_group, "_module_fqn", None) or "<root>"
    return module, [getattr(fp, "_param_fqn", None) or f"#{i}" for i, fp in enumerate(param_group.fsdp_params)]


def _has_grad(fsdp_param) -> bool:
    """FSDP2's own test (``FSDPParamGroup.post_backward``) of whether a
    parameter goes into the module's reduce-scatter."""
    if not hasattr(fsdp_param, "_unsharded_param"):
        return False
    return fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.unsharded_param.grad is not None


def _track_grads(param_group, rs: QuantizedReduceScatter | None, ag: QuantizedAllGather | None):
    """Makes the module's post-backward tell ``rs`` which parameters the coming
    reduce-scatter carries, just before FSDP2 decides the same thing, and drop
    what ``ag`` kept for the backward gather (FSDP2 runs every module's
    post-backward by the end of the backward, those the backward did not
    reach included)."""
    original = getattr(param_group, "_zeropp_post_backward", None) or param_group.post_backward

    def post_backward(*args, **kwargs):
        if rs is not None:
            rs.expect([_has_grad(fp) for fp in param_group.fsdp_params])
        try:
            return original(*args, **kwargs)
        finally:
            if ag is not None:
                ag.drop()

    param_group._zeropp_post_backward = original
    param_group.post_backward = post_backward


def _drop_after_eval(param_group, ag: QuantizedAllGather):
    """Makes the module's post-forward drop what ``ag`` kept for a backward
    gather when the forward ran without grad (no backward will come)."""
    original = getattr(param_group, "_zeropp_post_forward", None) or param_group.post_forward

    def post_forward(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            if not torch.is_grad_enabled():
                ag.drop()

    param_group._zeropp_post_forward = original
    param_group.post_forward = post_forward


def _phase(param_group):
    """``(pass, reshards)`` of a module now: FSDP2's training state as
    ``"forward"`` (its pre-forward or a forward prefetch), ``"backward"`` (its
    pre-backward or a backward prefetch) or None, and whether it reshards to
    the full shard group after forward (``reshard_after_forward=True``; not
    the root, which FSDP2 leaves unsharded, nor FSDP2's own hpZ)."""
    state = getattr(getattr(param_group, "_training_state", None), "name", None)
    phase = {"FORWARD": "forward", "PRE_BACKWARD": "backward"}.get(state)
    return phase, param_group.post_forward_mesh_info is param_group.mesh_info


def _replica_group(replicate):
    """The process group of ``replicate`` (None, a group or a 1-D DeviceMesh)."""
    if replicate is None:
        return None
    get_group = getattr(replicate, "get_group", None)
    if get_group is not None:
        if replicate.ndim != 1:
            raise _zeropp.ZeroppError(
                f"zeropp.torch.enable(replicate=...) takes a 1-D mesh (the replicate dimension), got "
                f"{replicate.ndim} dimensions")
        return get_group()
    if isinstance(replicate, torch.distributed.ProcessGroup):
        return replicate
    raise TypeError(f"zeropp.torch.enable(replicate=...) takes a ProcessGroup or a 1-D DeviceMesh, not a "
                    f"{type(replicate).__name__}")


def _check_replicas(shard_group, replica_group):
    """The replica group and the shard group meet in this rank only."""
    shard = set(torch.distributed.get_process_group_ranks(shard_group))
    reps = set(torch.distributed.get_process_group_ranks(replica_group))
    if shard & reps != {torch.distributed.get_rank()}:
        raise _zeropp.ZeroppError(
            f"zeropp.torch.enable(replicate=...): the replica group {sorted(reps)} and the shard group "
            f"{sorted(shard)} must share exactly this rank; pass mesh['replicate'] of the mesh whose "
            f"mesh['shard'] the model is sharded over")


def enable(model: torch.nn.Module, *, local_size: int | None = None, qwz: bool = True, qgz: bool = True,
           qwz_bits: int = 8, qgz_bits: int = 4, group_size: int = 256, stochastic: bool = True,
           exclude_1d: bool = True, seed: int = 0, replicate=None, quantize_intra: bool = False,
           qgz_two_level: bool = False, qgz_hadamard=None, hpz: bool | None = None) -> dict:
    """Turns qwZ and qgZ on for every FSDP2 module in ``model`` (call it after
    ``fully_shard``, on every rank). Returns a summary: modules changed, their
    sharding world, and whether hpZ (``reshard_after_forward=local_size``) is on.

    The defaults are the Rust engine's: INT8 weights and INT4 gradients in
    groups of 256, stochastic rounding in qgZ (seeded by ``seed``; every call
    draws its own stream), 1-D parameters reduced at their own precision;
    and, where the engine rotates nothing by default, qgZ's rotation of the
    parameters whose gradients it pays for (``qgz_hadamard``).
    Collectives whose group lies inside one node send nothing across nodes
    and run at full precision (torch's own) unless ``quantize_intra``.

    ``replicate`` (a process group or a 1-D ``DeviceMesh``: this rank's
    replicas, one rank each) turns on the quantized HSDP all-reduce
    (:class:`QuantizedAllReduce`, through FSDP2's all-reduce hook) for a model
    sharded over a 1-D mesh of the shard dimension: ``fully_shard(m,
    mesh=mesh["shard"])`` and ``enable(model, replicate=mesh["replicate"])``.
    On a native HSDP mesh torch runs its own all-reduce, which cannot be taken
    over; there ``replicate`` is an error and the all-reduce stays torch's.

    ``qgz_hadamard`` rotates qgZ's groups by a seeded, randomized Hadamard
    transform before quantizing them (SDP4Bit's smoothing), which spreads an
    outlier over its group. ``"auto"`` rotates the parameters whose gradients
    the rotation pays for: where it at least halves INT4's noise, measured on
    the gradient at the reduce-scatter's calls 1, 2, 4, 8, ... and agreed
    across the shard group (see :class:`AutoRotation`; :func:`rotated` says
    what it chose). On the HF Llama it chooses the MLP's down projections,
    whose INT4 error then stays flat with width (0.11-0.12 from 0.9M to 99.5M
    parameters; 0.18 growing to 0.25 unrotated). ``True`` rotates every group,
    ``False`` none, and a function of a parameter's name (its path from
    ``model``, e.g. ``"model.layers.0.mlp.down_proj.weight"``) the parameters
    it returns true for. The default (``None``) is ``"auto"`` wherever qgZ
    quantizes with a layout per parameter (``exclude_1d``) and a power-of-two
    ``group_size``, and off elsewhere (a one-node job, ``qgz=False``); given
    explicitly, each choice is an error where it cannot act, and a function
    and ``"auto"`` also need ``exclude_1d``. A module holding an embedding
    (``nn.Embedding``, ``nn.EmbeddingBag``, or a weight tied to one) is never
    rotated (see ``_holds_embedding``); the rotation changes no byte on the
    wire. ``summary["qgz_rotation"]`` says which modules may rotate
    (``"auto"`` where the gradients choose), ``summary["qgz_rotated"]``
    which parameters an explicit choice rotates.

    ``qgz_two_level`` (INT8 inside the node, INT4 across) and
    ``qgz_hadamard`` are SDP4Bit's options of qgZ: see
    :class:`QuantizedReduceScatter`. Where they cannot act they are an error,
    not a silent no-op: with ``qgz=False``, and where a module's shard group
    lies inside one node (a one-node job, or HSDP with a replica per node,
    whose replica all-reduce has neither option) unless ``quantize_intra``.

    ``hpz`` (default: on with qwZ) keeps, for every module that FSDP2 reshards
    fully after forward (``fully_shard(m)``, ``reshard_after_forward=True``),
    the INT8 encodings of its node's share of the forward gather (one byte per
    element, ``1/local_size`` of the module), so its backward gather runs
    inside the node and decodes the forward's bytes. Modules sharded with
    FSDP2's own hpZ (``reshard_after_forward=local_size``, a copy in the
    parameters' dtype) keep it. ``summary["hpz"]`` says which each module got.

    Non-finite gradients keep FSDP2's contract: a NaN or ±Inf poisons its
    quantization group, which arrives as NaN at every rank that owns part of
    it (through qgZ, the HSDP all-reduce and qwZ alike), so the script's own
    check (``clip_grad_norm_``'s norm, ``GradScaler``) sees it on every rank
    and skips the step there. No rank raises, none waits, and nothing is read
    back to the host to find it. The weight-difference half of SDP4Bit
    (the Rust engine's qwZ-delta) needs state kept between FSDP2's
    all-gathers that its all-gather slot does not give, so it is not here.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zeropp.torch.enable takes the model (a torch.nn.Module after fully_shard), "
                        f"not a {type(model).__name__}")
    for hook in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        if not hasattr(FSDPModule, hook):
            raise _zeropp.ZeroppError(
                f"this torch ({torch.__version__}) has no FSDPModule.{hook}: zeropp.torch needs FSDP2's "
                f"custom collectives (torch >= 2.9; tested with 2.9.0 and 2.15.0)")
    ls = local_size if local_size is not None else _env_local_size()
    # The default rotation is "auto" where it can act and off elsewhere; an
    # explicit choice is an error where it cannot act.
    implicit = qgz_hadamard is None
    if implicit:
        can = qgz and exclude_1d and hadamard_group_fits(group_size)
        qgz_hadamard = "auto" if can else False
    pick = qgz_hadamard if callable(qgz_hadamard) else None
    auto = isinstance(qgz_hadamard, str) and qgz_hadamard == "auto"
    if pick is None and not auto and not isinstance(qgz_hadamard, bool):
        raise TypeError(f"zeropp.torch.enable: qgz_hadamard takes \"auto\", True, False, None (the default) or "
                        f"a function of a parameter's name, not {qgz_hadamard!r}")
    if (pick is not None or auto) and not exclude_1d:
        raise _zeropp.ZeroppError(
            "zeropp.torch.enable: a per-parameter qgz_hadamard (a function, or \"auto\") needs each parameter to "
            "start at a group boundary, which exclude_1d=False gives up; pass qgz_hadamard=True or keep exclude_1d")
    if (qgz_two_level or qgz_hadamard) and not qgz:
        raise _zeropp.ZeroppError(
            "zeropp.torch.enable: qgz_two_level and qgz_hadamard are options of qgZ's reduce-scatter, which "
            "qgz=False turns off; drop them or keep qgZ on")
    if qgz_hadamard:
        check_hadamard_group(group_size)
    if hpz and not qwz:
        raise _zeropp.ZeroppError(
            "zeropp.torch.enable: zeropp's hpZ keeps qwZ's INT8 encodings for the backward gather, so it needs "
            "qwz=True; for hpZ without qwZ shard with FSDP2's reshard_after_forward=local_size instead")
    hpz = qwz if hpz is None else hpz
    shared = _Shared(seed)
    replica_group = _replica_group(replicate)
    installed = []
    module_names = {id(m): n for n, m in model.named_modules()}
    if pick is not None:
        _check_pick(model, pick, module_names, FSDPModule)
    summary = {"modules": 0, "world": None, "local_size": ls, "hpz": [], "qgz_rotation": [], "qgz_rotated": [],
               "replicas": 1 if replica_group is None else replica_group.size()}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        pg = _param_group(module)
        if pg is None:
            continue
        group = pg.mesh_info.shard_process_group
        all_groups = _shard_groups(pg.mesh_info)
        # Reused across enable() calls (created once per mesh; see release()).
        topo = shared_topology(group, ls, all_groups)
        quantizes = topo.nodes > 1 or quantize_intra
        # A module holding an embedding stays unrotated.
        rotate = bool(qgz_hadamard) and quantizes and not _holds_embedding(pg)
        if auto and quantizes and not _holds_embedding(pg):
            rotate = AutoRotation([not one_d for _, one_d in _segments(pg, topo.world)])
        elif rotate:
            # Which parameters rotate: the quantized ones (1-D ones are reduced
            # exactly), all or the function's choice.
            names = _param_names(pg, module_names)
            flags = [not one_d and (pick is None or bool(pick(n)))
                     for n, (_, one_d) in zip(names, _segments(pg, topo.world))]
            summary["qgz_rotated"] += [n for n, f in zip(names, flags) if f]
            if pick is not None:
                rotate = flags if any(flags) else False
        if (qgz_two_level or (qgz_hadamard and not implicit)) and not quantizes:
            where = ("the replica all-reduce (QuantizedAllReduce: INT4 out, INT8 back) has neither option"
                     if replica_group is not None else "no byte of it crosses a node")
            raise _zeropp.ZeroppError(
                f"zeropp.torch.enable: qgz_two_level and qgz_hadamard cannot act here: module "
                f"'{_names(pg)[0]}' is sharded over ranks {topo.ranks}, inside one node, so its reduce-scatter "
                f"is torch's own at full precision, and {where}. Drop them, or pass quantize_intra=True to "
                f"quantize the reduce-scatter inside the node too")
        segs = _segments(pg, topo.world)
        ag = None
        if qwz:
            ag = QuantizedAllGather(ls, segments=segs, bits=qwz_bits, group_size=group_size,
                                    exclude_1d=exclude_1d, quantize_intra=quantize_intra, topology=topo, hpz=hpz,
                                    phase=lambda pg=pg: _phase(pg))
            module.set_custom_all_gather(ag)
            installed.append(ag)
            _drop_after_eval(pg, ag)
        factor = (lambda pg=pg: getattr(pg, "gradient_divide_factor", None))
        rs = QuantizedReduceScatter(
            topo, segments=segs if exclude_1d else None, bits=qgz_bits, group_size=group_size,
            stochastic=stochastic, shared=shared, names=lambda pg=pg: _names(pg)[1],
            module=lambda pg=pg: _names(pg)[0], divide_factor=factor, quantize_intra=quantize_intra,
            two_level=qgz_two_level, hadamard=rotate)
        if qgz or replica_group is not None or ag is not None:
            # The reduce-scatter's layout (which parameters this backward sends)
            # serves the replica all-reduce too.
            _track_grads(pg, rs if qgz or replica_group is not None else None, ag)
        if qgz:
            module.set_custom_reduce_scatter(rs)
        if qgz or replica_group is not None:
            installed.append(rs)
        if replica_group is not None:
            if getattr(pg, "_is_hsdp", False):
                raise _zeropp.ZeroppError(
                    f"zeropp.torch.enable(replicate=...): module '{_names(pg)[0]}' is sharded over a native "
                    f"HSDP mesh, whose all-reduce torch runs itself (FSDP2 has no way to replace it). Shard "
                    f"over the shard dimension only, fully_shard(m, mesh=mesh['shard']), and pass "
                    f"replicate=mesh['replicate']")
            _check_replicas(group, replica_group)
            ar = QuantizedAllReduce(
                replica_group, bits=qgz_bits, group_size=group_size, stochastic=stochastic, shared=shared,
                plan=rs._plan, divide_factor=factor)
            module.set_all_reduce_hook(ar)
            installed.append(ar)
        summary["modules"] += 1
        summary["world"] = topo.world
        summary["qgz_rotation"].append(
            "auto" if isinstance(rotate, AutoRotation) else bool(qgz and (rotate is not False)))
        post = getattr(pg, "post_forward_mesh_info", None)
        # Which hpZ the module gets: FSDP2's (reshard_after_forward=local_size), zeropp's
        # (INT8 node copy, for a module resharded fully after forward), or none.
        if post is not None and post is not pg.mesh_info and post.shard_mesh_size <= ls:
            summary["hpz"].append("fsdp2")
        elif ag is not None and hpz and topo.nodes > 1 and topo.local_size > 1 and post is pg.mesh_info:
            summary["hpz"].append("zeropp")
        else:
            summary["hpz"].append(None)
    _INSTALLED[model] = installed
    if summary["modules"] == 0:
        # Training on would silently run at full precision: refuse instead.
        raise _zeropp.ZeroppError(
            f"zeropp.torch.enable: {type(model).__name__} holds no FSDP2 module with parameters; call "
            f"torch.distributed.fsdp.fully_shard on it (and on its blocks) first, then enable()")
    return summary
