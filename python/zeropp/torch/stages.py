"""qgZ's local stages in torch ops (:class:`TorchQgzStages`), for gradients
that stay on their device.

The same stages, buffers and wire bytes as the Rust ``zeropp.QgzStages``
(see its docstring): ``pack``, an all-to-all in the node, ``reduce_intra``,
an all-to-all over the rail, ``finish``. The buffers are torch tensors on the
gradient's device instead of host memory. With round-to-nearest the shard
and every byte sent equal the Rust stages' (checked in
``python/tests/test_torch_kernels.py``); with stochastic rounding the uniforms come
from torch's generator, one stream per ``(seed, rank, hop)``.

Every stage works shard by shard and in column blocks
(:func:`zeropp.torch.kernels.blocks`), so its scratch is a few blocks, and
reads nothing back to the host. A non-finite gradient value poisons its
quantization group on the way (:mod:`zeropp.torch.kernels`), so it arrives
as NaN at the rank that owns it.
"""

from __future__ import annotations

import torch

from . import kernels as K


class FlatSource:
    """A flat gradient of ``n`` elements as qgZ's shards of ``s``: shard
    ``p`` is elements ``p*s..(p+1)*s``, zeros past the end."""

    def __init__(self, grad: torch.Tensor, n: int, s: int):
        self.x, self.n, self.s = grad.reshape(-1), n, s

    def cols(self, part: int, a: int, b: int) -> torch.Tensor:
        """Columns ``a..b`` of shard ``part`` as float32 ``[1, b-a]``."""
        lo = min(self.n, part * self.s + a)
        hi = min(self.n, part * self.s + b)
        v = self.x[lo:hi].to(torch.float32)
        if hi - lo < b - a:
            v = torch.nn.functional.pad(v, (0, b - a - (hi - lo)))
        return v[None]


class TorchQgzStages:
    """The local stages of one qgZ reduce-scatter of an ``n``-element float32
    gradient for ``rank`` of ``world = nodes x local_size`` ranks (node-major),
    in torch ops. Arguments as ``zeropp.QgzStages``; non-finite values always
    propagate (the Rust stages' ``propagate=True``)."""

    def __init__(self, world: int, local_size: int, rank: int, n: int, *, bits: int = 4,
                 group_size: int = 256, local_bits: int = 8, seed: int | None = None, mean: bool = True,
                 intra_bits: int | None = None, hadamard: int | None = None, propagate: bool = True):
        if local_size < 1 or world % local_size:
            raise K._zeropp.ZeroppError(f"qgz: a world of {world} ranks is not nodes x {local_size}")
        if not 0 <= rank < world:
            raise K._zeropp.ZeroppError(f"qgz: rank {rank} outside a world of {world}")
        if not propagate:
            raise K._zeropp.ZeroppError("qgz: the torch-op stages always propagate non-finite values "
                                        "(they read nothing back to check them)")
        self.world, self.local, self.rank, self.n = world, local_size, rank, n
        self.nodes = world // local_size
        self.s = -(-n // world)
        self.bits, self.local_bits, self.gs = bits, local_bits, group_size
        # SDP4Bit's two levels: the intra-node hop at intra_bits, the rail hop at bits.
        self.intra_bits = bits if intra_bits is None else intra_bits
        self.seed, self.mean, self.hadamard = seed, mean, hadamard
        if hadamard is not None:
            check_hadamard_group(group_size)
        self.me_node, self.me_local = divmod(rank, local_size)
        self._ea = K.encoded_len(self.s, self.intra_bits, group_size)
        self._ei = K.encoded_len(self.s, bits, group_size)
        self._el = K.encoded_len(self.s, local_bits, group_size)
        multi = local_size > 1 and world > 1
        self.shard_len = self.s
        self.intra_chunk_len = self.nodes * self._ea if multi else 0
        self.own_len = self.nodes * self._el if multi else 0
        self.inter_chunk_len = self._ei if self.nodes > 1 else 0

    def _rot(self, v: torch.Tensor, part: int, a: int, inverse: bool = False) -> torch.Tensor:
        """Block ``v`` (columns ``a..`` of shard ``part``) rotated with the
        Hadamard option (at stream position ``part * s + a``); as it is without."""
        if self.hadamard is None:
            return v
        return K.rotate(v, group_size=self.gs, seed=self.hadamard, starts=[part * self.s + a], inverse=inverse)

    def _gen(self, hop: int, device):
        return K.generator(self.seed, [self.rank, hop], device)

    def _blocks(self):
        return K.blocks(1, self.s, self.gs)

    def _encode(self, src, part: int, out: torch.Tensor, bits: int, gen):
        """Shard ``part`` of ``src``, rotated, into the encoding ``out`` ([E] bytes)."""
        enc = K.Encoder(out[None], self.s, bits=bits, group_size=self.gs)
        for a, b in self._blocks():
            enc.put(a, self._rot(src.cols(part, a, b), part, a), gen)

    def _check(self, what: str, t: torch.Tensor, expected: int):
        if t.numel() != expected:
            raise K._zeropp.ZeroppError(f"qgz: {what} has {t.numel()} bytes or elements, expected {expected}")

    def _checks(self, shard, intra, own, inter_send):
        self._check("the shard", shard, self.s)
        self._check("the intra-node buffer", intra, self.local * self.intra_chunk_len)
        self._check("the own-chunk buffer", own, self.own_len)
        self._check("the inter-node send buffer", inter_send, self.nodes * self.inter_chunk_len)

    def pack(self, grad, intra_send: torch.Tensor, own: torch.Tensor, inter_send: torch.Tensor,
             shard: torch.Tensor):
        """Stage 1: reorder and quantize the gradient into the send buffers
        (the chunk for this rank itself stays zero); ``shard`` is reset.
        ``grad`` is the flat float32 gradient (``n`` elements) or a source
        with ``cols(part, a, b)`` (columns of one shard, as :class:`FlatSource`)."""
        src = grad if hasattr(grad, "cols") else FlatSource(grad, self.n, self.s)
        if not hasattr(grad, "cols"):
            self._check("the gradient", grad, self.n)
        self._checks(shard, intra_send, own, inter_send)
        if self.world == 1:
            for a, b in self._blocks():
                shard[a:b] = src.cols(0, a, b)[0]
            return
        L, N = self.local, self.nodes
        dev = shard.device
        shard.zero_()
        if L > 1:
            chunks = intra_send.view(L, N, self._ea)
            mine = own.view(N, self._el)
            g_intra, g_own = self._gen(1, dev), self._gen(11, dev)
            for j in range(L):
                if j == self.me_local:
                    chunks[j].zero_()
                    continue
                for m in range(N):
                    self._encode(src, m * L + j, chunks[j, m], self.intra_bits, g_intra)
            for m in range(N):
                self._encode(src, m * L + self.me_local, mine[m], self.local_bits, g_own)
        else:
            # The sum runs in the rotated basis (with the Hadamard option); finish rotates it back.
            for a, b in self._blocks():
                shard[a:b] += self._rot(src.cols(self.me_node, a, b), self.me_node, a)[0]
            slots = inter_send.view(N, self._ei)
            gen = self._gen(1, dev)
            for m in range(N):
                if m != self.me_node:
                    self._encode(src, m, slots[m], self.bits, gen)

    def reduce_intra(self, intra_recv: torch.Tensor, own: torch.Tensor, inter_send: torch.Tensor,
                     shard: torch.Tensor):
        """Stage 3: sums the node's contributions to each shard this rank
        forwards (in local-rank order, from zero); the own node's stays in
        float32 in ``shard``, the others are requantized into ``inter_send``."""
        self._checks(shard, intra_recv, own, inter_send)
        L, N = self.local, self.nodes
        if L <= 1 or self.world == 1:
            return
        recv = intra_recv.view(L, N, self._ea)
        mine = own.view(N, self._el)
        slots = inter_send.view(N, self._ei) if self.inter_chunk_len else None
        gen = self._gen(2, shard.device)
        for m in range(N):
            wires = [(mine[m], self.local_bits) if j == self.me_local else (recv[j, m], self.intra_bits)
                     for j in range(L)]
            enc = None if m == self.me_node else K.Encoder(slots[m][None], self.s, bits=self.bits,
                                                           group_size=self.gs)
            for a, b in self._blocks():
                acc = torch.zeros(1, b - a, dtype=torch.float32, device=shard.device)
                for w, bits in wires:
                    acc += K.decode(w[None], self.s, a, b, bits=bits, group_size=self.gs)
                if enc is None:
                    shard[a:b] += acc[0]
                else:
                    enc.put(a, acc, gen)

    def finish(self, inter_recv: torch.Tensor, shard: torch.Tensor):
        """Stage 5: adds the other nodes' partial sums (node order), applies
        the mean and zeroes the shard's padding."""
        self._check("the shard", shard, self.s)
        N = self.nodes
        if N > 1 and self.world > 1:
            self._check("the inter-node receive buffer", inter_recv, N * self._ei)
            rows = inter_recv.view(N, self._ei)
            for m in range(N):
                if m == self.me_node:
                    continue
                for a, b in self._blocks():
                    shard[a:b] += K.decode(rows[m][None], self.s, a, b, bits=self.bits, group_size=self.gs)[0]
        if self.world > 1 and self.hadamard is not None:
            for a, b in self._blocks():
                shard[a:b] = self._rot(shard[a:b][None], self.rank, a, inverse=True)[0]
        if self.mean and self.world > 1:
            shard.div_(float(self.world))
        real = max(0, min(self.s, self.n - self.rank * self.s))
        shard[real:] = 0.0


def hadamard_group_fits(group_size: int) -> bool:
    """Whether the Hadamard rotation takes this group size: a power of two of
    at most ``HADAMARD_MAX_GROUP``, as the Rust kernels."""
    return 0 < group_size <= K._zeropp.HADAMARD_MAX_GROUP and group_size & (group_size - 1) == 0


def check_hadamard_group(group_size: int):
    """Refuses a group size the Hadamard rotation cannot take (see
    :func:`hadamard_group_fits`)."""
    top = K._zeropp.HADAMARD_MAX_GROUP
    if not hadamard_group_fits(group_size):
        raise K._zeropp.ZeroppError(
            f"qgZ: the Hadamard rotation needs a power-of-two group size of at most {top}, got {group_size}")
