"""ZeRO++ for PyTorch FSDP2: qwZ and qgZ as FSDP2's custom collectives.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a module replace its
all-gather and reduce-scatter. This module fills those slots:

- :class:`QuantizedAllGather` (qwZ): each rank quantizes its shard to INT8
  (one scale per group of 256), the encodings travel through torch's
  ``all_gather_into_tensor``, and every rank dequantizes all of them, its own
  included, so all ranks compute with the same weights.
- :class:`QuantizedReduceScatter` (qgZ): the gradient's shards are reordered
  and quantized to INT4, exchanged inside the node (``all_to_all_single`` on a
  node sub-group), summed and requantized, exchanged once more over the rail
  (the ranks with the same local rank, one per node), and summed again. The
  stages are the Rust engine's own (``zeropp.QgzStages``): same slice order,
  same defaults (INT4 groups of 256 on the wire, INT8 for the chunk a rank
  keeps, stochastic rounding, 1-D parameters such as biases and norms reduced
  at their own precision).
- hpZ is FSDP2's own ``reshard_after_forward=local_size``: after the forward,
  each node keeps the weights sharded over its own ranks, so the backward
  all-gather stays inside the node (and is not quantized again).

The transport is torch.distributed itself (gloo on CPU, NCCL on GPU): you keep
``torchrun`` and your process groups. Ranks must be numbered node by node
(rank = node * local_size + local rank), as torchrun does.

Five lines turn it on in an FSDP2 script::

    import zeropp.torch as zt
    local = zt.local_size()                       # ranks per node (torchrun's LOCAL_WORLD_SIZE)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=local)   # hpZ
    fully_shard(model, reshard_after_forward=local)
    zt.enable(model, local_size=local)            # qwZ + qgZ

The kernels run on the CPU. Tensors on a GPU are staged through host memory
(correct, not fast; zeropp's CUDA kernels are not wired to Python yet).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import _zeropp
from . import _as_buffer

__all__ = [
    "ByteCounter",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "Topology",
    "enable",
    "local_size",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Kind keys of the stochastic-rounding streams (as the Rust engine's: qwZ 1, qgZ 2).
_QGZ_STREAM = 2


def local_size() -> int:
    """Ranks per node: ``ZEROPP_LOCAL_SIZE`` when set (as for the Rust engine
    under mpirun; it lets one machine pose as several nodes), else torchrun's
    ``LOCAL_WORLD_SIZE``, else 1."""
    for var in ("ZEROPP_LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        v = os.environ.get(var)
        if v:
            try:
                n = int(v)
            except ValueError:
                raise _zeropp.ZeroppError(f"{var}={v!r} is not a number of ranks per node") from None
            if n < 1:
                raise _zeropp.ZeroppError(f"{var}={v!r}: a node has at least one rank")
            return n
    return 1


class Topology:
    """A process group seen as nodes, with its sub-groups: one per node
    (intra-node) and one per position within a node (the rail). A rank's node
    is its global rank // ``local_size``; the group's members on each node must
    be consecutive in the group and equal in number (``self.local_size`` of
    them: ``local_size`` for a group of whole nodes, fewer for a group that
    takes part of each node, as HSDP's and FSDP + TP's shard groups do).

    Creating one is a collective call: every rank of the default group must
    create the same topologies in the same order (``torch.distributed.new_group``).
    Under HSDP (or FSDP + TP) each rank's shard group is a different one, so pass
    ``all_groups``, every shard group's ranks (the same list on every rank): the
    sub-groups of all of them are created on every rank, in one order.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, local_size: int | None = None, *,
                 all_groups=None):
        group = group if group is not None else dist.group.WORLD
        ls = local_size if local_size is not None else globals()["local_size"]()
        if ls < 1:
            raise _zeropp.ZeroppError(f"local_size {ls}: a node has at least one rank")
        ranks = list(dist.get_process_group_ranks(group))
        groups = [list(g) for g in all_groups] if all_groups is not None else [ranks]
        if ranks not in groups:
            raise _zeropp.ZeroppError(f"all_groups {groups} does not hold the group's ranks {ranks}")
        self.group = group
        self.ranks = ranks
        self.world = len(ranks)
        self.nodes, self.local_size = _node_layout(ranks, ls)
        me = dist.get_rank()
        self.rank = ranks.index(me) if me in ranks else -1
        self.intra = None
        self.rail = None
        # Every rank creates every sub-group of every group, in the same order.
        layouts = [(g, _node_layout(g, ls)[1]) for g in groups]
        for g, per in layouts:
            for m in range(len(g) // per):
                members = g[m * per:(m + 1) * per]
                sub = dist.new_group(members)
                if me in members and g == ranks:
                    self.intra = sub
        for g, per in layouts:
            for j in range(per):
                members = g[j::per]
                sub = dist.new_group(members)
                if me in members and g == ranks:
                    self.rail = sub

    def node_of(self, global_rank: int) -> int:
        """The node of a member (by its position in the group), from 0."""
        return self.ranks.index(global_rank) // self.local_size

    def matches(self, group: dist.ProcessGroup) -> bool:
        """True when ``group`` has exactly this topology's ranks."""
        return dist.get_process_group_ranks(group) == self.ranks


def _node_layout(ranks, ls: int):
    """``(nodes, members per node)`` of a group whose ranks sit on nodes of
    ``ls`` ranks (node = global rank // ls): each node's members consecutive in
    the group and equal in number, or a :class:`ZeroppError` saying why not."""
    runs = []
    for r in ranks:
        node = r // ls
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        elif any(n == node for n, _ in runs):
            raise _zeropp.ZeroppError(
                f"the group's ranks {list(ranks)} visit node {node} (of {ls} ranks) twice: zeropp needs "
                f"each node's members consecutive in the group")
        else:
            runs.append([node, 1])
    per = {k for _, k in runs}
    if len(per) != 1:
        raise _zeropp.ZeroppError(
            f"the group's ranks {list(ranks)} take unequal numbers of ranks from the nodes of {ls} "
            f"({', '.join(f'node {n}: {k}' for n, k in runs)}); zeropp needs the same number on every node")
    return len(runs), per.pop()


def _shard_groups(mesh_info):
    """Every shard group of FSDP2's device mesh (the same list on every rank):
    one group for plain FSDP, one per replica under HSDP."""
    mesh = mesh_info.mesh.mesh
    dim = mesh_info.shard_mesh_dim
    return mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist()


def _spans_nodes(group: dist.ProcessGroup, ls: int) -> bool:
    """True when the group's ranks sit on more than one node of ``ls`` ranks
    (node = global rank // ls)."""
    return len({r // ls for r in dist.get_process_group_ranks(group)}) > 1


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


@dataclass
class _Shared:
    """What the collectives of one :func:`enable` share: the stream counter
    (the same on every rank, since all ranks run the same collectives in the
    same order) and the topologies by group."""

    seed: int
    calls: int = 0
    topologies: dict = field(default_factory=dict)

    def next_seed(self) -> int:
        self.calls += 1
        return _zeropp.stream_seed(self.seed, [_QGZ_STREAM, self.calls])


class _Collective:
    """What both collectives share: the layout of the chunk FSDP2 sends
    (``segments``), the quantizer's format, and the protocols' ``allocate``."""

    def __init__(self, segments, bits: int, group_size: int):
        self.segments = list(segments) if segments else None
        self.bits = bits
        self.group_size = group_size

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_Collective):
    """qwZ: FSDP2's all-gather with INT8 block-quantized payloads.

    ``allocate`` and ``__call__`` follow ``torch.distributed.fsdp``'s
    ``AllGather`` protocol. ``segments`` describes one rank's input as
    ``[(elements, is_1d), ...]``, one entry per parameter shard (FSDP2
    concatenates them): each parameter is quantized on its own, so no
    quantization group mixes two parameters (a LayerNorm gain of 1.0 would
    otherwise set the scale for the matrix weights beside it), and the 1-D
    parameters travel unquantized (``exclude_1d``). Without ``segments`` the
    whole input is one quantized vector. Gathers inside one node (hpZ's
    backward gather under ``reshard_after_forward=local_size``) and inputs that
    are not floats (FSDP2 sends mixed dtypes as uint8) go through torch's plain
    all-gather; set ``quantize_intra=True`` to quantize those too.
    """

    def __init__(self, local_size: int, *, segments=None, bits: int = 8, group_size: int = 256,
                 quantize_intra: bool = False, exclude_1d: bool = True):
        super().__init__(segments, bits, group_size)
        self.local_size = local_size
        self.quantize_intra = quantize_intra
        self.exclude_1d = exclude_1d

    def _layout(self, n: int, itemsize: int):
        """[(start, elements, exact, wire offset, wire bytes)] over one rank's input."""
        segs = self.segments
        if segs and sum(k for k, _ in segs) != n:
            if not getattr(self, "_warned", False):
                warnings.warn(f"qwZ: the parameter layout covers {sum(k for k, _ in segs)} elements, the "
                              f"all-gather input has {n}; quantizing it as one vector", stacklevel=2)
                self._warned = True
            segs = None
        segs = segs or [(n, False)]
        out, at, off = [], 0, 0
        for k, one_d in segs:
            exact = one_d and self.exclude_1d
            size = k * itemsize if exact else _zeropp.encoded_len(k, bits=self.bits, group_size=self.group_size)
            out.append((at, k, exact, off, size))
            at += k
            off += size
        return out, off

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        quantize = input_tensor.dtype in _FLOATS and (
            self.quantize_intra or _spans_nodes(group, self.local_size)
        )
        if not quantize:
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        g = group.size()
        n = input_tensor.numel()
        if output_tensor.numel() != g * n:
            raise _zeropp.ZeroppError(
                f"qwZ all-gather: output has {output_tensor.numel()} elements, expected {g} x {n}"
            )
        layout, e = self._layout(n, input_tensor.element_size())
        x = _host(input_tensor.contiguous()).reshape(-1)
        send = torch.empty(e, dtype=torch.uint8)
        sb = send.numpy()
        xb, dtype = _as_buffer(x, "input_tensor")
        xbytes = x.view(torch.uint8).numpy()
        isz = x.element_size()
        for at, k, exact, off, size in layout:
            if exact:
                sb[off:off + size] = xbytes[at * isz:(at + k) * isz]
            else:
                _zeropp.quantize(xb[at:at + k], sb[off:off + size], dtype=dtype, bits=self.bits,
                                 group_size=self.group_size)
        dev = input_tensor.device
        recv = torch.empty(g * e, dtype=torch.uint8, device=dev)
        dist.all_gather_into_tensor(recv, send.to(dev), group=group)
        recv = _host(recv)
        # Every rank dequantizes every shard, its own included, so all ranks compute
        # with the same weights (the input may be a view of the output; it has been
        # read already).
        out = output_tensor if dev.type == "cpu" else torch.empty(g * n, dtype=output_tensor.dtype)
        out = out.reshape(-1)
        ob, odt = _as_buffer(out, "output_tensor")
        obytes = out.view(torch.uint8).numpy()
        rb = recv.numpy()
        for j in range(g):
            base = j * e
            for at, k, exact, off, size in layout:
                wire = rb[base + off:base + off + size]
                if exact:
                    obytes[(j * n + at) * isz:(j * n + at + k) * isz] = wire
                else:
                    _zeropp.dequantize(wire, ob[j * n + at:j * n + at + k], dtype=odt)
        if dev.type != "cpu":
            output_tensor.copy_(out.view_as(output_tensor))
        return None


class QuantizedReduceScatter(_Collective):
    """qgZ: FSDP2's reduce-scatter as a two-hop INT4 all-to-all.

    Follows ``torch.distributed.fsdp``'s ``ReduceScatter`` protocol. The
    input is FSDP2's rank-major buffer (chunk ``r`` holds what rank ``r``
    owns); the output is this rank's chunk of the mean (``ReduceOp.AVG``) or
    sum (``ReduceOp.SUM``). ``segments`` describes the chunk's layout as
    ``[(elements, is_1d), ...]``, one entry per parameter: the 1-D segments
    (biases, norm weights) are reduced by torch's reduce-scatter at the input's
    own precision, and the rest goes through qgZ with each parameter in groups
    of its own (padded to a group boundary, so no group holds two parameters),
    as the Rust engine does by default. FSDP2 sends only the parameters that
    have a gradient: :meth:`expect` says which before each call (:func:`enable`
    does it). Other ops (a pre-multiplied sum) and non-float inputs fall back to
    torch's reduce-scatter.
    """

    def __init__(self, topology: Topology, *, segments=None, bits: int = 4, group_size: int = 256,
                 local_bits: int = 8, stochastic: bool = True, seed: int = 0, shared: _Shared | None = None,
                 names=None, module: str = ""):
        super().__init__(segments, bits, group_size)
        self.topology = topology
        self.local_bits = local_bits
        self.stochastic = stochastic
        self.shared = shared if shared is not None else _Shared(seed)
        # The parameters' names and the module's, for errors: lists and strings,
        # or callables returning them (FSDP2 names them at its lazy init).
        self.names = names
        self.module = module
        # Which of ``segments`` the next call carries (None: all of them).
        self._sent = None
        self._masks = {}

    def expect(self, sent):
        """Tells the next call which of ``segments`` it carries: FSDP2
        reduce-scatters only the parameters that have a gradient (frozen ones,
        and trainable ones this backward did not reach, are left out), so
        :func:`enable` calls this from the module's post-backward hook, with
        FSDP2's own test, before FSDP2 builds the input."""
        if self.segments is not None and len(sent) != len(self.segments):
            raise _zeropp.ZeroppError(
                f"qgZ: {len(sent)} flags for a layout of {len(self.segments)} parameters")
        self._sent = tuple(bool(x) for x in sent)

    def _plan(self, c: int):
        """How one chunk of ``c`` elements is reduced: ``(mask, src, dst, cq)``.
        ``mask`` marks the 1-D parameters' elements (reduced exactly; None when
        there are none); qgZ reduces a vector of ``cq`` elements per rank in which
        chunk position ``src[i]`` sits at ``dst[i]``, each parameter starting on a
        group boundary so no quantization group holds two parameters (the Rust
        engine's ``per_tensor_groups``). Without ``segments``: the whole chunk,
        as it is (``src`` None)."""
        if not self.segments:
            return None, None, None, c
        sent = self._sent if self._sent is not None else (True,) * len(self.segments)
        key = (sent, c)
        if key not in self._masks:
            segs = [seg for seg, keep in zip(self.segments, sent) if keep]
            total = sum(n for n, _ in segs)
            if total != c:
                names = self.names() if callable(self.names) else self.names
                names = list(names or [f"#{i}" for i in range(len(self.segments))])
                carried = [n for n, keep in zip(names, sent) if keep]
                module = self.module() if callable(self.module) else self.module
                where = f" of module '{module}'" if module else ""
                raise _zeropp.ZeroppError(
                    f"qgZ: FSDP2 sent {c} elements per rank for the reduce-scatter{where}, but the "
                    f"parameters it reduces ({', '.join(carried) or 'none'}) cover {total} per rank in "
                    f"zeropp's layout. A module given to QuantizedReduceScatter by hand needs expect() "
                    f"before each call (enable() does this); otherwise pass exclude_1d=False to enable(), "
                    f"which quantizes the chunk as one vector and needs no layout")
            mask = torch.zeros(c, dtype=torch.bool)
            src, dst = [], []
            at, cq, gs = 0, 0, self.group_size
            for n, one_d in segs:
                if one_d:
                    mask[at:at + n] = True
                elif n:
                    src.append(torch.arange(at, at + n))
                    dst.append(torch.arange(cq, cq + n))
                    cq += -(-n // gs) * gs
                at += n
            cat = (lambda v: torch.cat(v)) if src else (lambda v: torch.zeros(0, dtype=torch.long))
            self._masks[key] = (mask if bool(mask.any()) else None, cat(src), cat(dst), cq)
        return self._masks[key]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        t = self.topology
        if op == dist.ReduceOp.AVG:
            mean = True
        elif op == dist.ReduceOp.SUM:
            mean = False
        else:
            mean = None
        if mean is None or input_tensor.dtype not in _FLOATS or group.size() == 1:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if not t.matches(group):
            raise _zeropp.ZeroppError(
                f"qgZ: FSDP2 reduces over ranks {dist.get_process_group_ranks(group)}, "
                f"but the topology was built for {t.ranks}"
            )
        w = t.world
        c = output_tensor.numel()
        if input_tensor.numel() != w * c:
            raise _zeropp.ZeroppError(f"qgZ: input has {input_tensor.numel()} elements, expected {w} x {c}")
        mask, src, dst, cq = self._plan(c)
        if cq == 0:
            # Only 1-D parameters (a norm layer on its own): nothing for qgZ.
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        dev = input_tensor.device
        x = _host(input_tensor).reshape(w, c)
        exact = None
        if mask is not None:
            cols = x[:, mask].contiguous()
            exact = torch.empty(cols.shape[1], dtype=input_tensor.dtype, device=dev)
            dist.reduce_scatter_tensor(exact, cols.reshape(-1).to(dev), op=op, group=group)
        # The quantized part in float32, each parameter from a group boundary.
        if src is None:
            xq = x.to(torch.float32, copy=True)
        else:
            xq = torch.zeros(w, cq, dtype=torch.float32)
            xq[:, dst] = x[:, src].to(torch.float32)
        seed = self.shared.next_seed() if self.stochastic else None
        st = _zeropp.QgzStages(w, t.local_size, t.rank, w * cq, bits=self.bits, group_size=self.group_size,
                               local_bits=self.local_bits, seed=seed, mean=mean)
        part = torch.empty(cq, dtype=torch.float32)
        intra_send = torch.zeros(t.local_size * st.intra_chunk_len, dtype=torch.uint8)
        own = torch.zeros(st.own_len, dtype=torch.uint8)
        inter_send = torch.zeros(t.nodes * st.inter_chunk_len, dtype=torch.uint8)
        st.pack(xq.reshape(-1).numpy(), intra_send.numpy(), own.numpy(), inter_send.numpy(), part.numpy())
        if st.intra_chunk_len:
            intra_recv = _all_to_all(intra_send, t.intra, dev)
            st.reduce_intra(intra_recv.numpy(), own.numpy(), inter_send.numpy(), part.numpy())
        inter_recv = torch.zeros(0, dtype=torch.uint8)
        if st.inter_chunk_len:
            inter_recv = _all_to_all(inter_send, t.rail, dev)
        st.finish(inter_recv.numpy(), part.numpy())
        if src is None:
            shard = part
        else:
            shard = torch.zeros(c, dtype=torch.float32)
            shard[src] = part[dst]
        if mask is not None:
            shard[mask] = _host(exact).to(torch.float32)
        output_tensor.copy_(shard.view_as(output_tensor).to(dev))
        return None


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup, dev: torch.device) -> torch.Tensor:
    """An equal-split all-to-all of a uint8 buffer on ``group``, on ``dev``'s backend."""
    recv = torch.empty_like(send, device=dev)
    dist.all_to_all_single(recv, send.to(dev), group=group)
    return _host(recv)


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
                f"({torch.__version__}) does not have; the tested version is 2.9.1"
            )
        rows = -(-size[0] // world) if len(size) else 1
        rest = 1
        for d in size[1:]:
            rest *= d
        segs.append((rows * rest, len(size) == 1))
    return segs


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


def _track_grads(param_group, rs: QuantizedReduceScatter):
    """Makes the module's post-backward tell ``rs`` which parameters the coming
    reduce-scatter carries, just before FSDP2 decides the same thing."""
    original = getattr(param_group, "_zeropp_post_backward", None) or param_group.post_backward

    def post_backward(*args, **kwargs):
        rs.expect([_has_grad(fp) for fp in param_group.fsdp_params])
        return original(*args, **kwargs)

    param_group._zeropp_post_backward = original
    param_group.post_backward = post_backward


def enable(model: torch.nn.Module, *, local_size: int | None = None, qwz: bool = True, qgz: bool = True,
           qwz_bits: int = 8, qgz_bits: int = 4, group_size: int = 256, stochastic: bool = True,
           exclude_1d: bool = True, seed: int = 0) -> dict:
    """Turns qwZ and qgZ on for every FSDP2 module in ``model`` (call it after
    ``fully_shard``, on every rank). Returns a summary: modules changed, their
    sharding world, and whether hpZ (``reshard_after_forward=local_size``) is on.

    The defaults are the Rust engine's: INT8 weights and INT4 gradients in
    groups of 256, stochastic rounding in qgZ (seeded by ``seed``; every call
    draws its own stream), 1-D parameters reduced at their own precision.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"zeropp.torch.enable takes the model (a torch.nn.Module after fully_shard), "
                        f"not a {type(model).__name__}")
    for hook in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        if not hasattr(FSDPModule, hook):
            raise _zeropp.ZeroppError(
                f"this torch ({torch.__version__}) has no FSDPModule.{hook}: zeropp.torch needs FSDP2's "
                f"custom collectives (torch >= 2.9; tested with 2.9.1)")
    ls = local_size if local_size is not None else globals()["local_size"]()
    shared = _Shared(seed)
    summary = {"modules": 0, "world": None, "local_size": ls, "hpz": []}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        pg = _param_group(module)
        if pg is None:
            continue
        group = pg.mesh_info.shard_process_group
        all_groups = _shard_groups(pg.mesh_info)
        key = tuple(tuple(g) for g in all_groups)
        if key not in shared.topologies:
            shared.topologies[key] = Topology(group, ls, all_groups=all_groups)
        topo = shared.topologies[key]
        segs = _segments(pg, topo.world)
        if qwz:
            module.set_custom_all_gather(QuantizedAllGather(
                ls, segments=segs, bits=qwz_bits, group_size=group_size, exclude_1d=exclude_1d))
        if qgz:
            rs = QuantizedReduceScatter(
                topo, segments=segs if exclude_1d else None, bits=qgz_bits, group_size=group_size,
                stochastic=stochastic, shared=shared, names=lambda pg=pg: _names(pg)[1],
                module=lambda pg=pg: _names(pg)[0])
            module.set_custom_reduce_scatter(rs)
            _track_grads(pg, rs)
        summary["modules"] += 1
        summary["world"] = topo.world
        post = getattr(pg, "post_forward_mesh_info", None)
        summary["hpz"].append(post is not None and post.shard_mesh_size <= ls)
    if summary["modules"] == 0:
        # Training on would silently run at full precision: refuse instead.
        raise _zeropp.ZeroppError(
            f"zeropp.torch.enable: {type(model).__name__} holds no FSDP2 module with parameters; call "
            f"torch.distributed.fsdp.fully_shard on it (and on its blocks) first, then enable()")
    return summary


class ByteCounter:
    """Counts the bytes each rank hands to torch.distributed's collectives,
    split into those bound for ranks on this rank's node and those bound for
    other nodes (node = global rank // local_size).

    It wraps the module functions ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, ``all_to_all_single`` and ``all_reduce`` (FSDP2's
    default collectives and zeropp's call them through ``torch.distributed``),
    so it sees both. Per call, with ``b`` the input's bytes and ``G`` the group
    size: an all-gather sends ``b`` to each other member; a reduce-scatter and an
    all-to-all send ``b/G`` to each; an all-reduce counts as a reduce-scatter plus
    an all-gather (``2b/G`` to each)::

        with ByteCounter(local_size=2) as bc:
            loss.backward()
        bc.inter, bc.intra      # bytes this rank sent across / within nodes
    """

    _FUNCS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce")

    def __init__(self, local_size: int):
        self.local_size = local_size
        self.inter = 0
        self.intra = 0
        self.calls = {f: 0 for f in self._FUNCS}
        self._saved = {}

    def _count(self, name, group, per_member_bytes: float):
        members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        me = dist.get_rank()
        node = me // self.local_size
        for r in members:
            if r == me:
                continue
            if r // self.local_size == node:
                self.intra += int(per_member_bytes)
            else:
                self.inter += int(per_member_bytes)
        self.calls[name] += 1

    def __enter__(self):
        for name in self._FUNCS:
            self._saved[name] = getattr(dist, name)
        counter = self

        def all_gather_into_tensor(output, input, group=None, async_op=False):
            counter._count("all_gather_into_tensor", group, input.numel() * input.element_size())
            return counter._saved["all_gather_into_tensor"](output, input, group=group, async_op=async_op)

        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = dist.get_world_size(group)
            counter._count("reduce_scatter_tensor", group, input.numel() * input.element_size() / g)
            return counter._saved["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            if input_split_sizes is not None:
                raise NotImplementedError("ByteCounter counts equal-split all-to-alls only")
            g = dist.get_world_size(group)
            counter._count("all_to_all_single", group, input.numel() * input.element_size() / g)
            return counter._saved["all_to_all_single"](output, input, output_split_sizes, input_split_sizes,
                                                       group=group, async_op=async_op)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = dist.get_world_size(group)
            counter._count("all_reduce", group, 2 * tensor.numel() * tensor.element_size() / g)
            return counter._saved["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        for f in (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, all_reduce):
            setattr(dist, f.__name__, f)
        return self

    def __exit__(self, *exc):
        for name, f in self._saved.items():
            setattr(dist, name, f)
        self._saved.clear()
        return False

