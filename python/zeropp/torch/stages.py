"""qgZ's local stages in torch ops (:class:`TorchQgzStages`), for gradients
that stay on their device.

The same stages, buffers and wire bytes as the Rust ``zeropp.QgzStages``
(see its docstring): ``pack``, an all-to-all in the node, ``reduce_intra``,
an all-to-all over the rail, ``finish``. The buffers are torch tensors on the
gradient's device instead of host memory. With round-to-nearest the shard
and every byte sent equal the Rust stages' (checked in
``python/tests/test_kernels.py``); with stochastic rounding the uniforms come
from torch's generator, one stream per ``(seed, rank, hop)``.
"""

from __future__ import annotations

import torch

from . import kernels as K


class TorchQgzStages:
    """The local stages of one qgZ reduce-scatter of an ``n``-element float32
    gradient for ``rank`` of ``world = nodes x local_size`` ranks (node-major),
    in torch ops. Arguments as ``zeropp.QgzStages``."""

    def __init__(self, world: int, local_size: int, rank: int, n: int, *, bits: int = 4,
                 group_size: int = 256, local_bits: int = 8, seed: int | None = None, mean: bool = True,
                 intra_bits: int | None = None, hadamard: int | None = None):
        if local_size < 1 or world % local_size:
            raise K._zeropp.ZeroppError(f"qgz: a world of {world} ranks is not nodes x {local_size}")
        if not 0 <= rank < world:
            raise K._zeropp.ZeroppError(f"qgz: rank {rank} outside a world of {world}")
        self.world, self.local, self.rank, self.n = world, local_size, rank, n
        self.nodes = world // local_size
        self.s = -(-n // world)
        self.bits, self.local_bits, self.gs = bits, local_bits, group_size
        # SDP4Bit's two levels: the intra-node hop at intra_bits, the rail hop at bits.
        self.intra_bits = bits if intra_bits is None else intra_bits
        self.seed, self.mean, self.hadamard = seed, mean, hadamard
        if hadamard is not None and (group_size < 1 or group_size & (group_size - 1)):
            raise K._zeropp.ZeroppError(
                f"qgz: the Hadamard rotation needs a power-of-two group size, got {group_size}")
        self.me_node, self.me_local = divmod(rank, local_size)
        self._ea = K.encoded_len(self.s, self.intra_bits, group_size)
        self._ei = K.encoded_len(self.s, bits, group_size)
        self._el = K.encoded_len(self.s, local_bits, group_size)
        multi = local_size > 1 and world > 1
        self.shard_len = self.s
        self.intra_chunk_len = self.nodes * self._ea if multi else 0
        self.own_len = self.nodes * self._el if multi else 0
        self.inter_chunk_len = self._ei if self.nodes > 1 else 0

    def _rotate(self, rows: torch.Tensor, parts, inverse: bool = False) -> torch.Tensor:
        """Rows rotated (with the Hadamard option), row ``i`` being shard
        ``parts[i]`` (at stream position ``parts[i] * s``); as they are without it."""
        if self.hadamard is None:
            return rows
        return K.hadamard_rows(rows, group_size=self.gs, seed=self.hadamard,
                               positions=[p * self.s for p in parts], inverse=inverse)

    def _gen(self, hop: int, device):
        return K.generator(self.seed, [self.rank, hop], device)

    def _check(self, what: str, t: torch.Tensor, expected: int):
        if t.numel() != expected:
            raise K._zeropp.ZeroppError(f"qgz: {what} has {t.numel()} bytes or elements, expected {expected}")

    def _checks(self, shard, intra, own, inter_send):
        self._check("the shard", shard, self.s)
        self._check("the intra-node buffer", intra, self.local * self.intra_chunk_len)
        self._check("the own-chunk buffer", own, self.own_len)
        self._check("the inter-node send buffer", inter_send, self.nodes * self.inter_chunk_len)

    def pack(self, grad: torch.Tensor, intra_send: torch.Tensor, own: torch.Tensor,
             inter_send: torch.Tensor, shard: torch.Tensor):
        """Stage 1: reorder and quantize ``grad`` into the send buffers (the
        chunk for this rank itself stays zero); ``shard`` is reset."""
        self._check("the gradient", grad, self.n)
        self._checks(shard, intra_send, own, inter_send)
        if self.world == 1:
            shard.copy_(grad)
            return
        w, s, L, N = self.world, self.s, self.local, self.nodes
        parts = torch.nn.functional.pad(grad.to(torch.float32), (0, w * s - self.n)).view(N, L, s)
        shard.zero_()
        if L > 1:
            others = [j for j in range(L) if j != self.me_local]
            chunks = intra_send.view(L, N, self._ea)
            if others:
                rows = parts[:, others, :].transpose(0, 1).reshape(-1, s)
                ids = [m * L + j for j in others for m in range(N)]
                enc = K.quantize_rows(self._rotate(rows, ids), bits=self.intra_bits, group_size=self.gs,
                                      generator=self._gen(1, grad.device))
                chunks[others] = enc.view(len(others), N, self._ea)
            chunks[self.me_local].zero_()
            mine = self._rotate(parts[:, self.me_local, :], [m * L + self.me_local for m in range(N)])
            own.view(N, self._el).copy_(K.quantize_rows(
                mine, bits=self.local_bits, group_size=self.gs, generator=self._gen(11, grad.device)))
        else:
            # The sum runs in the rotated basis (with the Hadamard option); finish rotates it back.
            shard.add_(self._rotate(parts[self.me_node, 0][None], [self.me_node])[0])
            others = [m for m in range(N) if m != self.me_node]
            slots = inter_send.view(N, self._ei)
            enc = K.quantize_rows(self._rotate(parts[others, 0], others), bits=self.bits, group_size=self.gs,
                                  generator=self._gen(1, grad.device))
            slots[others] = enc

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
        checks: list = []
        wires = [mine if j == self.me_local else recv[j] for j in range(L)]
        bits = [self.local_bits if j == self.me_local else self.intra_bits for j in range(L)]
        total = K.sum_rows(wires, self.s, bits_of=bits, group_size=self.gs, checks=checks)
        K.raise_unless(checks, "qgz: a local peer's encoding")
        shard.add_(total[self.me_node])
        others = [m for m in range(N) if m != self.me_node]
        if others:
            enc = K.quantize_rows(total[others], bits=self.bits, group_size=self.gs,
                                  generator=self._gen(2, shard.device))
            inter_send.view(N, self._ei)[others] = enc

    def finish(self, inter_recv: torch.Tensor, shard: torch.Tensor):
        """Stage 5: adds the other nodes' partial sums (node order), applies
        the mean and zeroes the shard's padding."""
        self._check("the shard", shard, self.s)
        N = self.nodes
        if N > 1 and self.world > 1:
            self._check("the inter-node receive buffer", inter_recv, N * self._ei)
            rows = inter_recv.view(N, self._ei)
            checks: list = []
            for m in range(N):
                if m != self.me_node:
                    shard.add_(K.dequantize_rows(rows[m:m + 1], self.s, bits=self.bits, group_size=self.gs,
                                                 checks=checks)[0])
            K.raise_unless(checks, "qgz: a rail peer's encoding")
        if self.world > 1 and self.hadamard is not None:
            shard.copy_(self._rotate(shard[None], [self.rank], inverse=True)[0])
        if self.mean and self.world > 1:
            shard.div_(float(self.world))
        real = max(0, min(self.s, self.n - self.rank * self.s))
        shard[real:] = 0.0
