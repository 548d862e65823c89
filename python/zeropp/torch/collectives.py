"""qwZ and qgZ as FSDP2's custom all-gather and reduce-scatter."""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _as_buffer, _zeropp
from . import kernels as K
from .rotation import AutoRotation
from .stages import TorchQgzStages, check_hadamard_group
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
    same order). Nothing of a step's size is kept between calls: the work
    buffers are made per call and freed after it, so what zeropp keeps
    between steps is the segment tables only (:func:`retained_bytes`)."""

    seed: int
    calls: int = 0
    rotations: int = 0

    def next_seed(self) -> int:
        self.calls += 1
        return _zeropp.stream_seed(self.seed, [_QGZ_STREAM, self.calls])

    def next_rotation(self) -> int:
        """The Hadamard rotation's seed for the next reduce-scatter (a stream of
        its own, so the stochastic-rounding seeds do not move with it)."""
        self.rotations += 1
        return _zeropp.stream_seed(self.seed, [_HADAMARD_STREAM, self.rotations])


class Layout:
    """One rank's chunk of an FSDP2 module (``segments``: ``(elements,
    is_1d)`` per parameter) as the vectors zeropp reduces: qgZ's vector of
    ``cq`` elements, every parameter from an ``align`` boundary (no
    quantization group holds two parameters), and the exact vector of the 1-D
    parameters (``k1`` elements). Holds segment tables only, no index
    tensors: the Rust path copies through ``zeropp.ChunkLayout`` (``rust``),
    the torch-op path slice by slice (``quantized``, ``exact``: ``(at, n,
    to)`` each)."""

    def __init__(self, segments, align: int, exclude_1d: bool = True):
        self.rust = _zeropp.ChunkLayout(list(segments), align=align, exclude_1d=exclude_1d)
        self.c, self.cq, self.k1 = self.rust.c, self.rust.cq, self.rust.exact_len
        self.quantized, self.exact = [], []
        # The entries of ``quantized`` whose groups qgZ rotates by torch ops
        # (a per-parameter rotation; see QuantizedReduceScatter).
        self.rotated = []
        # Their parameters' indices in the module's segments.
        self.rotated_index = []
        at = cq = k1 = 0
        for n, one_d in segments:
            if n and one_d and exclude_1d:
                self.exact.append((at, n, k1))
                k1 += n
            elif n:
                self.quantized.append((at, n, cq))
                cq += -(-n // align) * align
            at += n

    def nbytes(self) -> int:
        """What the tables take (an estimate: 64 bytes a segment, both copies)."""
        return 64 * (len(self.quantized) + len(self.exact))

    def exact_rows(self, x2: torch.Tensor) -> torch.Tensor:
        """The exact vectors of the rows of ``x2`` (``[rows, c]``) as float32
        ``[rows, k1]``, slice by slice."""
        out = torch.empty(x2.shape[0], self.k1, dtype=torch.float32, device=x2.device)
        for at, n, to in self.exact:
            out[:, to:to + n] = x2[:, at:at + n]
        return out

    def scatter(self, part: torch.Tensor, exact, out: torch.Tensor):
        """Writes one chunk ``out`` (``c`` elements) from its quantized vector
        ``part`` (``cq``) and exact vector ``exact`` (``k1``), slice by slice."""
        flat = out.view(-1)
        for at, n, to in self.quantized:
            flat[at:at + n] = part[to:to + n]
        for at, n, to in self.exact:
            flat[at:at + n] = exact[to:to + n]


def _rotate_columns(x2: torch.Tensor, segs, group_size: int, seed: int, starts, chunk: bool,
                    flags=None) -> torch.Tensor:
    """Rotates the whole groups of the segments ``segs`` (``(at, n, to)``:
    chunk column ``at``, qgZ column ``to``) of each row of ``x2`` in place
    (``chunk``: the columns are FSDP2's chunk's, ``at``; otherwise qgZ's
    shard's, ``to``; the inverse), row ``r``'s segment at stream position
    ``starts[r] + at``. ``flags`` (one per segment: a bool, or a 0-d bool
    tensor read on the device) keeps the rotation only where set. Returns
    ``x2``."""
    for k, (at, n, to) in enumerate(segs):
        flag = True if flags is None else flags[k]
        if flag is False:
            continue
        col = at if chunk else to
        r = K.rotate_on(x2[:, col:col + n], group_size=group_size, seed=seed,
                        starts=[p + at for p in starts], inverse=not chunk)
        x2[:, col:col + n] = r if flag is True else torch.where(flag, r, x2[:, col:col + n])
    return x2


class _LaidOut:
    """The rows of ``x2`` (``[rows, c]``, FSDP2's chunks) read through a
    :class:`Layout` as qgZ's shards, column block by column block (the
    source :class:`TorchQgzStages` reads; no copy of the whole gradient)."""

    def __init__(self, x2: torch.Tensor, layout: Layout):
        self.x2, self.lay = x2, layout
        self._starts = [to for _, _, to in layout.quantized]

    def cols(self, part: int, a: int, b: int) -> torch.Tensor:
        row = self.x2[part]
        segs = self.lay.quantized
        i = max(0, bisect.bisect_right(self._starts, a) - 1)
        if i < len(segs):
            at, n, to = segs[i]
            if to <= a and b <= to + n:
                # The block lies inside one parameter: one conversion, no zeros.
                return row[at + a - to:at + b - to].to(torch.float32)[None]
        out = torch.zeros(1, b - a, dtype=torch.float32, device=row.device)
        for at, n, to in segs[i:]:
            if to >= b:
                break
            lo, hi = max(a, to), min(b, to + n)
            if lo < hi:
                out[0, lo - a:hi - a] = row[at + lo - to:at + hi - to]
        return out


class _Collective:
    """What both collectives share: the layout of the chunk FSDP2 sends
    (``segments``), the quantizer's format, and the protocols' ``allocate``."""

    def __init__(self, segments, bits: int, group_size: int):
        self.segments = list(segments) if segments else None
        self.bits = bits
        self.group_size = group_size

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def retained_bytes(self) -> int:
        """Bytes this collective keeps between calls: every tensor it holds
        (none, by design) and its segment tables."""
        return _held_bytes(self.__dict__)


def _held_bytes(obj, seen=None) -> int:
    """The bytes of the tensors reachable from ``obj`` (dicts, lists, tuples
    and plain objects' attributes; callables and process groups are not
    followed), plus each :class:`Layout`'s tables."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, Layout):
        return obj.nbytes() + _held_bytes({k: v for k, v in obj.__dict__.items() if k != "rust"}, seen)
    if isinstance(obj, dict):
        return sum(_held_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(_held_bytes(v, seen) for v in obj)
    if isinstance(obj, (_Collective, _Shared)) or type(obj).__module__.startswith("zeropp"):
        return _held_bytes(getattr(obj, "__dict__", {}), seen)
    return 0


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
    all-gather; set ``quantize_intra=True`` to quantize those too. A NaN or
    ±Inf weight poisons its quantization group: every rank gathers that
    group as NaN (FSDP2 would gather the value itself), and nothing raises.

    **hpZ** (``hpz=True``, with ``topology`` and ``phase``): when the forward
    gather of a module that FSDP2 fully reshards after forward
    (``reshard_after_forward=True``) crosses nodes, each rank keeps the INT8
    encodings of the shards of its rail (the ranks with its local rank, one
    per node): ``1/local_size`` of the module at one byte per element. The
    backward gather then runs inside the node: each rank all-gathers its
    kept encodings with its local peers, and every rank decodes the same
    bytes the forward decoded, so the backward sees the forward's weights bit
    for bit. The encodings are dropped as the backward gather uses them, and
    by :meth:`drop`, which :func:`enable` calls from the module's
    post-backward and from its post-forward when the forward ran without
    grad (an evaluation), so nothing is kept between steps. ``phase()`` returns
    ``(pass, reshards)``: ``"forward"``, ``"backward"`` or None for the call
    under way, and whether the module reshards fully after forward (FSDP2's
    own hpZ, ``reshard_after_forward=local_size``, keeps a copy of its own;
    the root module is not resharded).
    """

    def __init__(self, local_size: int, *, segments=None, bits: int = 8, group_size: int = 256,
                 quantize_intra: bool = False, exclude_1d: bool = True, topology: Topology | None = None,
                 hpz: bool = False, phase=None):
        super().__init__(segments, bits, group_size)
        self.local_size = local_size
        self.quantize_intra = quantize_intra
        self.exclude_1d = exclude_1d
        if hpz and (topology is None or phase is None):
            raise _zeropp.ZeroppError("qwZ's hpZ needs the topology and the module's phase (enable() gives both)")
        self.topology = topology
        self.hpz = hpz
        self.phase = phase
        # The node's share of the last forward gather, kept for the backward one:
        # (input elements, wire bytes per rank, [nodes, E] encodings).
        self._kept = None

    def drop(self):
        """Forgets the encodings kept for the backward gather (if any)."""
        self._kept = None

    def _hpz_phase(self, group):
        """``(pass, reshards)`` when hpZ can act on this call, else None."""
        t = self.topology
        if not self.hpz or t.nodes < 2 or t.local_size < 2 or not t.matches(group):
            return None
        return self.phase()

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
        on_dev = K.use_torch(input_tensor)
        hpz = self._hpz_phase(group)
        kept, self._kept = self._kept, None
        if hpz is not None and hpz[0] == "backward" and kept is not None and kept[:2] == (n, e):
            return self._gather_in_node(output_tensor, kept[2], layout, e, on_dev)
        # (FSDP2 gathers under no_grad; a forward without grad drops what it kept at
        # the module's post-forward, see enable().)
        keep = hpz == ("forward", True)
        if on_dev:
            return self._gather_on_device(output_tensor, input_tensor, group, layout, e, keep)
        x = _host(input_tensor.contiguous()).reshape(-1)
        # One Rust call each way for the whole gather (the GIL released inside). The
        # buffers are the call's own: kept, they would hold a fraction of every
        # module's weights between steps.
        send = torch.empty(e, dtype=torch.uint8)
        xb, dtype = _as_buffer(x, "input_tensor")
        _zeropp.quantize_segments(xb, send.numpy(), layout, dtype=dtype, bits=self.bits,
                                  group_size=self.group_size, propagate=True)
        dev = input_tensor.device
        recv = torch.empty(g * e, dtype=torch.uint8, device=dev)
        dist.all_gather_into_tensor(recv, send.to(dev), group=group)
        del send
        recv = _host(recv)
        if keep:
            self._keep(recv, n, e)
        # Every rank dequantizes every shard, its own included, so all ranks compute
        # with the same weights (the input may be a view of the output; it has been
        # read already).
        self._decode_host(output_tensor, recv, layout, e)
        return None

    def _keep(self, recv: torch.Tensor, n: int, e: int):
        """Keeps this rank's rail of the gathered encodings (rank-major ``recv``)
        for the backward gather."""
        t = self.topology
        rail = recv.view(t.nodes, t.local_size, e)[:, t.rank % t.local_size].clone()
        self._kept = (n, e, rail)

    def _gather_in_node(self, output_tensor, rail, layout, e, on_dev):
        """hpZ's backward gather: the local peers' rails make every rank's
        encodings, decoded as the forward decoded them."""
        t = self.topology
        dev = output_tensor.device
        recv = torch.empty(t.local_size * rail.numel(), dtype=torch.uint8, device=dev)
        dist.all_gather_into_tensor(recv, rail.reshape(-1).to(dev), group=t.intra)
        del rail
        # [local rank][node] to rank-major [node][local rank].
        rows = recv.view(t.local_size, t.nodes, e).transpose(0, 1).reshape(t.world, e)
        if on_dev:
            self._decode_rows(output_tensor, rows, layout)
        else:
            self._decode_host(output_tensor, _host(rows), layout, e)
        return None

    def _decode_host(self, output_tensor, recv, layout, e):
        """The Rust kernels' decode of ``recv`` (rank-major encodings, host)
        into ``output_tensor``."""
        g = recv.numel() // e
        n = output_tensor.numel() // g
        direct = output_tensor.device.type == "cpu" and output_tensor.is_contiguous()
        out = (output_tensor if direct else torch.empty(g * n, dtype=output_tensor.dtype)).reshape(-1)
        ob, odt = _as_buffer(out, "output_tensor")
        _zeropp.dequantize_segments(recv.contiguous().reshape(-1).numpy(), ob, layout, dtype=odt, bits=self.bits,
                                    group_size=self.group_size, ranks=g, wire_stride=e, out_stride=n)
        if not direct:
            output_tensor.copy_(out.view_as(output_tensor))

    def _decode_rows(self, output_tensor, rows, layout):
        """The torch-op decode of ``rows`` (``[ranks, E]``, rank-major) into
        ``output_tensor``, a block at a time."""
        g = rows.shape[0]
        out = output_tensor.view(g, -1)
        for at, k, exact, off, size in layout:
            wire = rows[:, off:off + size]
            if exact:
                out[:, at:at + k] = wire.contiguous().view(out.dtype)
                continue
            for a, b in K.blocks(g, k, self.group_size):
                out[:, at + a:at + b] = K.decode(wire, k, a, b, bits=self.bits, group_size=self.group_size)

    def _gather_on_device(self, output_tensor, input_tensor, group, layout, e, keep=False):
        """The gather with the torch-op kernels (:mod:`.kernels`): the
        encodings are made, sent and decoded on the input's device, a block
        at a time, with no read-back to the host."""
        g, n = group.size(), input_tensor.numel()
        x = input_tensor.contiguous().reshape(-1)
        send = torch.empty(e, dtype=torch.uint8, device=x.device)
        for at, k, exact, off, size in layout:
            if exact:
                send[off:off + size] = x[at:at + k].view(torch.uint8)
                continue
            enc = K.Encoder(send[off:off + size][None], k, bits=self.bits, group_size=self.group_size)
            for a, b in K.blocks(1, k, self.group_size):
                enc.put(a, x[at + a:at + b].to(torch.float32)[None])
        recv = torch.empty(g * e, dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(recv, send, group=group)
        del send
        if keep:
            self._keep(recv, n, e)
        self._decode_rows(output_tensor, recv.view(g, e), layout)
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

    ``hadamard`` may also be a sequence of flags, one per entry of
    ``segments``: only the flagged parameters' groups are rotated (by torch
    ops before the stages and after them; the groups of the others are
    quantized exactly as unrotated). A rotation is linear, so the sums of
    the two hops run in the rotated basis, and every rank rotates the same
    positions with the same signs. Or an :class:`AutoRotation` (what
    :func:`enable` passes by default), which chooses the flags from the
    gradients themselves at calls 1, 2, 4, 8, ...
    """

    def __init__(self, topology: Topology, *, segments=None, bits: int = 4, group_size: int = 256,
                 local_bits: int = 8, stochastic: bool = True, seed: int = 0, shared: _Shared | None = None,
                 names=None, module: str = "", divide_factor=None, quantize_intra: bool = False,
                 two_level: bool = False, hadamard=False):
        super().__init__(segments, bits, group_size)
        # Per parameter (a sequence of flags) or the whole chunk (a bool).
        self.rotate_params = None
        self.auto = None
        if isinstance(hadamard, AutoRotation):
            if segments is None or len(hadamard.candidates) != len(segments):
                raise _zeropp.ZeroppError(
                    f"qgZ: an automatic rotation needs one candidate flag per parameter of the layout "
                    f"(segments, which exclude_1d=True gives); got {len(hadamard.candidates)} for "
                    f"{'no layout' if segments is None else f'{len(segments)} parameters'}")
            self.auto = hadamard
            hadamard = False
        elif not isinstance(hadamard, bool):
            flags = tuple(bool(f) for f in hadamard)
            if segments is None or len(flags) != len(segments):
                raise _zeropp.ZeroppError(
                    f"qgZ: a per-parameter rotation needs one flag per parameter of the layout (segments, "
                    f"which exclude_1d=True gives); got {len(flags)} flags for "
                    f"{'no layout' if segments is None else f'{len(segments)} parameters'}")
            self.rotate_params = flags if any(flags) else None
            hadamard = False
        if hadamard or self.rotate_params or self.auto is not None:
            check_hadamard_group(group_size)
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

    def _plan(self, c: int, rotate=None) -> Layout:
        """How one chunk of ``c`` elements is reduced: a :class:`Layout`, the
        parameters this call carries (:meth:`expect`) with the 1-D ones reduced
        exactly and each other parameter from a group boundary (the Rust
        engine's ``per_tensor_groups``). Without ``segments``: the whole chunk
        as one quantized vector. ``rotate`` (default: the current choice,
        ``rotate_params``) flags the parameters whose groups rotate. Cached
        per set of carried and rotated parameters: segment tables only."""
        if not self.segments:
            key = (None, c)
            if key not in self._masks:
                self._masks[key] = Layout([(c, False)], align=1)
            return self._masks[key]
        sent = self._sent if self._sent is not None else (True,) * len(self.segments)
        rotate = self.rotate_params if rotate is None else rotate
        key = (sent, c, rotate)
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
            lay = Layout(segs, align=self.group_size)
            if rotate is not None:
                index = [i for i, ((n, one_d), keep) in enumerate(zip(self.segments, sent))
                         if keep and n and not one_d]
                lay.rotated = [q for q, i in zip(lay.quantized, index) if rotate[i]]
                lay.rotated_index = [i for i in index if rotate[i]]
            self._masks[key] = lay
        return self._masks[key]

    def _choose(self, x2: torch.Tensor, c: int, group, device):
        """The automatic rotation's choice for this call, the same on every
        rank (measured at calls 1, 2, 4, ... from an all-reduced figure).
        Returns the layout that carries it and, while the choice is still
        on the device, a flag per rotated entry (the layout then rotates
        every candidate and keeps the rotation where the flag is set);
        otherwise None."""
        a = self.auto
        if a.due():
            lay = self._plan(c)
            sent = self._sent if self._sent is not None else (True,) * len(self.segments)
            carried = [i for i, ((n, one_d), keep) in enumerate(zip(self.segments, sent))
                       if keep and n and not one_d]
            a.measure(x2, lay.quantized, carried, self.group_size, group, device)
        if a.settle():
            self.rotate_params = a.chosen if any(a.chosen) else None
            return self._plan(c), None
        lay = self._plan(c, a.candidates)
        return lay, a.device_flags(lay.rotated_index)

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
        lay = self._plan(c)
        if lay.cq == 0:
            # Only 1-D parameters (a norm layer on its own): nothing for qgZ.
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return self._scale(output_tensor, post)
        dev = input_tensor.device
        # The torch-op kernels keep everything on the input's device; the Rust
        # kernels work in host memory.
        on_dev = K.use_torch(input_tensor)
        home = dev if on_dev else torch.device("cpu")
        x = (input_tensor if on_dev else _host(input_tensor)).contiguous().reshape(-1)
        if not on_dev and x.dtype == torch.float64:
            x = x.to(torch.float32)
        flags = None
        if self.auto is not None:
            lay, flags = self._choose(x.view(w, lay.c), c, group, input_tensor.device)
        seed = self.shared.next_seed() if self.stochastic else None
        rotation = self.shared.next_rotation() if self.hadamard else None
        some = self.shared.next_rotation() if lay.rotated else None
        if some is not None:
            # The flagged parameters' groups, rotated in a copy (float32, so
            # that the rotation rounds once).
            x = _rotate_columns(x.to(torch.float32, copy=True).view(w, lay.c), lay.rotated, self.group_size,
                                some, [p * lay.c for p in range(w)], chunk=True, flags=flags).reshape(-1)
        stages = TorchQgzStages if on_dev else _zeropp.QgzStages
        st = stages(w, t.local_size, t.rank, w * lay.cq, bits=self.bits, group_size=self.group_size,
                    local_bits=self.local_bits, seed=seed, mean=mean,
                    intra_bits=8 if self.two_level else None, hadamard=rotation, propagate=True)
        arg = (lambda b: b) if on_dev else (lambda b: b.numpy())
        # This call's work buffers (freed when it returns). Pack writes every byte
        # that travels; the slots a rank keeps for itself are zeroed.
        me_local, me_node = t.rank % t.local_size, t.rank // t.local_size
        part = torch.empty(lay.cq, dtype=torch.float32, device=home)
        intra_send = torch.empty(t.local_size * st.intra_chunk_len, dtype=torch.uint8, device=home)
        if st.intra_chunk_len:
            intra_send.view(t.local_size, -1)[me_local].zero_()
        own = torch.empty(st.own_len, dtype=torch.uint8, device=home)
        inter_send = torch.empty(t.nodes * st.inter_chunk_len, dtype=torch.uint8, device=home)
        if st.inter_chunk_len:
            inter_send.view(t.nodes, -1)[me_node].zero_()
        if on_dev:
            x2 = x.view(w, lay.c)
            st.pack(_LaidOut(x2, lay), intra_send, own, inter_send, part)
            # The 1-D parameters' columns: [node, local rank, elements], by owning rank.
            ones = lay.exact_rows(x2).view(t.nodes, t.local_size, -1) if lay.k1 else None
        else:
            xb, dt = _as_buffer(x, "input_tensor")
            st.pack_layout(xb, lay.rust, arg(intra_send), arg(own), arg(inter_send), arg(part), dtype=dt)
            ones = None
            if lay.k1:
                ones = torch.empty(w, lay.k1, dtype=torch.float32)
                lay.rust.exact(xb, ones.numpy(), dtype=dt, rows=w)
                ones = ones.view(t.nodes, t.local_size, -1)
        # The 1-D parameters' columns ride along qgZ's two all-to-alls as raw float32
        # (no collective of their own). partial[m]: this node's float32 sum of the
        # columns of shard (m, my local rank).
        partial = None if ones is None else ones[:, me_local]
        if st.intra_chunk_len:
            # Local peer j gets the columns of shards (m, j), m = 0..N, after its qgZ chunk.
            extra = None if ones is None else ones.transpose(0, 1).reshape(t.local_size, -1)
            intra_recv, got = _all_to_all_with(intra_send, extra, t.local_size, t.intra, dev, home)
            del intra_send
            if got is not None:
                got = got.view(t.local_size, t.nodes, -1)
                partial = got[0].clone()
                for k in range(1, t.local_size):
                    partial += got[k]
            st.reduce_intra(arg(intra_recv), arg(own), arg(inter_send), arg(part))
            del intra_recv
        del own
        inter_recv = torch.zeros(0, dtype=torch.uint8, device=home)
        exact = None if partial is None else partial[me_node]
        if st.inter_chunk_len:
            # Rail peer m gets partial[m]; this rank's shard is the sum of what every node sends.
            inter_recv, got = _all_to_all_with(inter_send, partial, t.nodes, t.rail, dev, home)
            if got is not None:
                exact = got[0].clone()
                for m in range(1, t.nodes):
                    exact += got[m]
        del inter_send
        st.finish(arg(inter_recv), arg(part))
        del inter_recv
        if some is not None:
            part = _rotate_columns(part.view(1, -1), lay.rotated, self.group_size, some, [t.rank * lay.c],
                                   chunk=False, flags=flags).view(-1)
        if exact is not None and mean:
            exact /= float(w)
        self._write(output_tensor, part, exact, lay, on_dev)
        return self._scale(output_tensor, post)

    @staticmethod
    def _write(output_tensor: torch.Tensor, part: torch.Tensor, exact, lay: Layout, on_dev: bool):
        """The reduced chunk into ``output_tensor``, from qgZ's shard ``part``
        and the exact vector, straight into the output where it can."""
        if on_dev:
            lay.scatter(part, exact, output_tensor)
            return
        direct = output_tensor.device.type == "cpu" and output_tensor.is_contiguous() and \
            output_tensor.dtype in _FLOATS
        out = output_tensor if direct else torch.empty(output_tensor.numel(), dtype=torch.float32)
        ob, odt = _as_buffer(out.reshape(-1), "output_tensor")
        ex = None if exact is None else exact.contiguous().numpy()
        lay.rust.scatter(part.numpy(), ob, dtype=odt, exact=ex)
        if not direct:
            output_tensor.copy_(out.view_as(output_tensor))

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
