"""qwZ and qgZ as FSDP2's custom all-gather and reduce-scatter."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import _as_buffer, _zeropp
from . import kernels as K
from .stages import TorchQgzStages
from .topology import Topology, _spans_nodes

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Kind keys of the streams (as the Rust engine's: qwZ 1, qgZ 2, the Hadamard signs 3).
_QGZ_STREAM = 2
_HADAMARD_STREAM = 3


def _host(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


@dataclass
class _Shared:
    """What the collectives of one :func:`enable` share: the stream counter
    (the same on every rank, since all ranks run the same collectives in the
    same order) and qgZ's host work buffers."""

    seed: int
    calls: int = 0
    rotations: int = 0
    pool: dict = field(default_factory=dict)

    def next_seed(self) -> int:
        self.calls += 1
        return _zeropp.stream_seed(self.seed, [_QGZ_STREAM, self.calls])

    def next_rotation(self) -> int:
        """The Hadamard rotation's seed for the next reduce-scatter (a stream of
        its own, so the stochastic-rounding seeds do not move with it)."""
        self.rotations += 1
        return _zeropp.stream_seed(self.seed, [_HADAMARD_STREAM, self.rotations])

    def zeros(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed work buffer. In host memory it is kept across steps and shared by
        the modules whose buffers have the same size (a model's blocks), so a step
        does not map fresh pages for it (a large allocation is an mmap that faults
        its pages in, every time); the collectives are synchronous, so no two calls
        hold it at once. On a device, torch's caching allocator already does this."""
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        key = (name, tuple(shape), dtype)
        buf = self.pool.get(key)
        if buf is None:
            buf = self.pool[key] = torch.zeros(shape, dtype=dtype)
        else:
            buf.zero_()
        return buf


class _Collective:
    """What both collectives share: the layout of the chunk FSDP2 sends
    (``segments``), the quantizer's format, and the protocols' ``allocate``."""

    def __init__(self, segments, bits: int, group_size: int):
        self.segments = list(segments) if segments else None
        self.bits = bits
        self.group_size = group_size

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _buffer(self, name: str, n: int, device: torch.device) -> torch.Tensor:
        """A uint8 work buffer of ``n`` bytes, kept across steps (the same
        module gathers the same sizes every step). Only for buffers no caller
        holds after the collective returns."""
        bufs = self.__dict__.setdefault("_bufs", {})
        key = (name, n, device)
        if key not in bufs:
            bufs[key] = torch.empty(n, dtype=torch.uint8, device=device)
        return bufs[key]


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
        if K.use_torch(input_tensor):
            return self._gather_on_device(output_tensor, input_tensor, group, layout, e)
        x = _host(input_tensor.contiguous()).reshape(-1)
        # One Rust call each way for the whole gather (the GIL released inside).
        send = self._buffer("send", e, torch.device("cpu"))
        xb, dtype = _as_buffer(x, "input_tensor")
        _zeropp.quantize_segments(xb, send.numpy(), layout, dtype=dtype, bits=self.bits,
                                  group_size=self.group_size)
        dev = input_tensor.device
        # (Not kept: it holds the whole module's weights, which ZeRO-3 does not keep.)
        recv = torch.empty(g * e, dtype=torch.uint8, device=dev)
        dist.all_gather_into_tensor(recv, send.to(dev), group=group)
        recv = _host(recv)
        # Every rank dequantizes every shard, its own included, so all ranks compute
        # with the same weights (the input may be a view of the output; it has been
        # read already).
        out = output_tensor if dev.type == "cpu" else torch.empty(g * n, dtype=output_tensor.dtype)
        out = out.reshape(-1)
        ob, odt = _as_buffer(out, "output_tensor")
        _zeropp.dequantize_segments(recv.numpy(), ob, layout, dtype=odt, bits=self.bits,
                                    group_size=self.group_size, ranks=g, wire_stride=e, out_stride=n)
        if dev.type != "cpu":
            output_tensor.copy_(out.view_as(output_tensor))
        return None

    def _gather_on_device(self, output_tensor, input_tensor, group, layout, e):
        """The gather with the torch-op kernels (:mod:`.kernels`): the
        encodings are made, sent and decoded on the input's device."""
        g, n = group.size(), input_tensor.numel()
        x = input_tensor.contiguous().reshape(-1)
        parts = [x[at:at + k].view(torch.uint8) if exact else
                 K.quantize_rows(x[at:at + k][None], bits=self.bits, group_size=self.group_size)[0]
                 for at, k, exact, _, _ in layout]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=x.device)
        recv = torch.empty(g * e, dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(recv, send, group=group)
        rows = recv.view(g, e)
        out = output_tensor.view(g, n)
        checks: list = []
        for at, k, exact, off, size in layout:
            wire = rows[:, off:off + size].contiguous()
            if exact:
                out[:, at:at + k] = wire.view(out.dtype)
            else:
                out[:, at:at + k] = K.dequantize_rows(wire, k, bits=self.bits, group_size=self.group_size,
                                                      checks=checks).to(out.dtype)
        K.raise_unless(checks, "qwZ all-gather: a peer's encoding")
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
    does it). A pre-multiplied sum (``ReduceOp.PREMUL_SUM``, what FSDP2 sends
    after ``set_gradient_divide_factor``) is the sum scaled by the factor's
    inverse, read from ``divide_factor`` (a number, or a callable returning
    it; :func:`enable` passes the module's). Any other op, and a non-float
    input, is a :class:`ZeroppError`: never a silent fallback. A group inside
    one node (HSDP's shard group when a replica is a node, or a one-node job)
    sends no byte across nodes, so it goes through torch's reduce-scatter at
    full precision; ``quantize_intra=True`` quantizes it too.

    SDP4Bit's options: ``two_level=True`` sends the intra-node hop at INT8 and
    only the rail hop at ``bits``; ``hadamard=True`` rotates every quantization
    group by a seeded, randomized Hadamard transform before its first
    quantization and each rank's shard back after the last sum, which spreads
    an outlier over its group (``group_size`` must be a power of two). Both
    keep the Rust engine's arithmetic (``zeropp.QgzStages``, or the torch ops
    of the device path, byte for byte with round-to-nearest).
    """

    def __init__(self, topology: Topology, *, segments=None, bits: int = 4, group_size: int = 256,
                 local_bits: int = 8, stochastic: bool = True, seed: int = 0, shared: _Shared | None = None,
                 names=None, module: str = "", divide_factor=None, quantize_intra: bool = False,
                 two_level: bool = False, hadamard: bool = False):
        super().__init__(segments, bits, group_size)
        if hadamard and (group_size < 1 or group_size & (group_size - 1)):
            raise _zeropp.ZeroppError(
                f"qgZ: the Hadamard rotation needs a power-of-two group size, got {group_size}")
        self.two_level = two_level
        self.hadamard = hadamard
        self.quantize_intra = quantize_intra
        self.divide_factor = divide_factor
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
        mean, op, post = self._op(op)
        if input_tensor.dtype not in _FLOATS + (torch.float64,):
            raise _zeropp.ZeroppError(
                f"qgZ: FSDP2 reduce-scatters {input_tensor.dtype}; zeropp quantizes float gradients only "
                f"(float32, bfloat16, float16, float64)")
        if group.size() == 1:
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return self._scale(output_tensor, post)
        if not t.matches(group):
            raise _zeropp.ZeroppError(
                f"qgZ: FSDP2 reduces over ranks {dist.get_process_group_ranks(group)}, "
                f"but the topology was built for {t.ranks}"
            )
        if t.nodes == 1 and not self.quantize_intra:
            # A shard group inside one node (HSDP's, or a one-node job): no byte
            # crosses a node, so torch's reduce-scatter keeps full precision.
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return self._scale(output_tensor, post)
        w = t.world
        c = output_tensor.numel()
        if input_tensor.numel() != w * c:
            raise _zeropp.ZeroppError(f"qgZ: input has {input_tensor.numel()} elements, expected {w} x {c}")
        mask, src, dst, cq = self._plan(c)
        if cq == 0:
            # Only 1-D parameters (a norm layer on its own): nothing for qgZ.
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return self._scale(output_tensor, post)
        dev = input_tensor.device
        # The torch-op kernels keep everything on the input's device; the Rust
        # kernels work in host memory.
        on_dev = K.use_torch(input_tensor)
        home = dev if on_dev else torch.device("cpu")
        if on_dev and src is not None:
            mask, src, dst = (None if mask is None else mask.to(dev)), src.to(dev), dst.to(dev)
        x = (input_tensor if on_dev else _host(input_tensor)).reshape(w, c)
        # The 1-D parameters' columns ride along qgZ's two all-to-alls as raw float32
        # (no collective of their own): [node, local rank, elements], by owning rank.
        ones = None if mask is None else x[:, mask].to(torch.float32).reshape(t.nodes, t.local_size, -1)
        # The quantized part in float32, each parameter from a group boundary.
        if src is None:
            xq = x.to(torch.float32, copy=True)
        else:
            xq = self.shared.zeros("xq", (w, cq), torch.float32, home)
            xq[:, dst] = x[:, src].to(torch.float32)
        seed = self.shared.next_seed() if self.stochastic else None
        rotation = self.shared.next_rotation() if self.hadamard else None
        stages = TorchQgzStages if on_dev else _zeropp.QgzStages
        st = stages(w, t.local_size, t.rank, w * cq, bits=self.bits, group_size=self.group_size,
                    local_bits=self.local_bits, seed=seed, mean=mean,
                    intra_bits=8 if self.two_level else None, hadamard=rotation)
        arg = (lambda b: b) if on_dev else (lambda b: b.numpy())
        zeros = self.shared.zeros
        part = zeros("part", (cq,), torch.float32, home)
        intra_send = zeros("intra_send", (t.local_size * st.intra_chunk_len,), torch.uint8, home)
        own = zeros("own", (st.own_len,), torch.uint8, home)
        inter_send = zeros("inter_send", (t.nodes * st.inter_chunk_len,), torch.uint8, home)
        st.pack(arg(xq.reshape(-1)), arg(intra_send), arg(own), arg(inter_send), arg(part))
        # partial[m]: this node's float32 sum of the 1-D columns of shard (m, my local rank).
        partial = None if ones is None else ones[:, t.rank % t.local_size]
        if st.intra_chunk_len:
            # Local peer j gets the columns of shards (m, j), m = 0..N, after its qgZ chunk.
            extra = None if ones is None else ones.transpose(0, 1).reshape(t.local_size, -1)
            intra_recv, got = _all_to_all_with(intra_send, extra, t.local_size, t.intra, dev, home)
            if got is not None:
                got = got.view(t.local_size, t.nodes, -1)
                partial = got[0].clone()
                for k in range(1, t.local_size):
                    partial += got[k]
            st.reduce_intra(arg(intra_recv), arg(own), arg(inter_send), arg(part))
        inter_recv = torch.zeros(0, dtype=torch.uint8, device=home)
        exact = None if partial is None else partial[t.rank // t.local_size]
        if st.inter_chunk_len:
            # Rail peer m gets partial[m]; this rank's shard is the sum of what every node sends.
            inter_recv, got = _all_to_all_with(inter_send, partial, t.nodes, t.rail, dev, home)
            if got is not None:
                exact = got[0].clone()
                for m in range(1, t.nodes):
                    exact += got[m]
        st.finish(arg(inter_recv), arg(part))
        if exact is not None and mean:
            exact /= float(w)
        if src is None:
            shard = part
        else:
            shard = torch.zeros(c, dtype=torch.float32, device=home)
            shard[src] = part[dst]
        if mask is not None:
            shard[mask] = exact
        output_tensor.copy_(shard.view_as(output_tensor).to(dev))
        return self._scale(output_tensor, post)

    def _op(self, op):
        """``(mean, op for torch's own reduce-scatters, post-scale or None)``
        for FSDP2's ``op``."""
        if op == dist.ReduceOp.AVG:
            return True, dist.ReduceOp.AVG, None
        if op == dist.ReduceOp.SUM:
            return False, dist.ReduceOp.SUM, None
        if op == dist.ReduceOp.PREMUL_SUM:
            factor = self.divide_factor() if callable(self.divide_factor) else self.divide_factor
            if factor is None or not factor:
                raise _zeropp.ZeroppError(
                    "qgZ: FSDP2 sent a pre-multiplied sum (ReduceOp.PREMUL_SUM, from "
                    "set_gradient_divide_factor), but no divide factor is known to zeropp: torch does not "
                    "expose it on the op. enable() reads it from the module; a QuantizedReduceScatter made by "
                    "hand needs divide_factor=")
            return False, dist.ReduceOp.SUM, 1.0 / float(factor)
        raise _zeropp.ZeroppError(
            f"qgZ: FSDP2 sent ReduceOp {op}; zeropp reduces SUM, AVG and PREMUL_SUM (what FSDP2 sends)")

    @staticmethod
    def _scale(output_tensor: torch.Tensor, post):
        if post is not None:
            output_tensor.mul_(post)
        return None


def _all_to_all_with(send: torch.Tensor, extra, peers: int, group: dist.ProcessGroup, dev: torch.device,
                     home: torch.device):
    """:func:`_all_to_all` of ``send`` (``peers`` equal chunks) with ``extra``
    (float32 ``[peers, k]``, row ``j`` for peer ``j``) appended to each chunk;
    returns what arrived of both (the second as float32 ``[peers, k]``, or None
    without ``extra``)."""
    if extra is None:
        return _all_to_all(send, group, dev, home), None
    chunk = send.numel() // peers
    both = torch.cat([send.view(peers, chunk), extra.contiguous().view(torch.uint8)], dim=1)
    recv = _all_to_all(both.reshape(-1), group, dev, home).view(peers, -1)
    return recv[:, :chunk].contiguous().reshape(-1), recv[:, chunk:].contiguous().view(torch.float32)


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup, dev: torch.device,
                home: torch.device) -> torch.Tensor:
    """An equal-split all-to-all of a uint8 buffer on ``group``, through
    ``dev`` (the backend's device); the result on ``home``."""
    recv = torch.empty_like(send, device=dev)
    dist.all_to_all_single(recv, send.to(dev), group=group)
    return recv.to(home)
