"""The torch-op kernels (zeropp.torch.kernels, the device path) equal the Rust
kernels (issue 24, test 4).

With round-to-nearest, every byte must be the same: the encodings of
``quantize_rows`` against ``zeropp.quantize``, the values of
``dequantize_rows`` against ``zeropp.dequantize``, and every buffer and shard
of a whole qgZ reduce-scatter (``TorchQgzStages`` against the Rust
``QgzStages``, its all-to-alls done by hand), at odd lengths and group
sizes, INT8 and INT4, float32, bfloat16 and float16 inputs. With stochastic
rounding the bits differ by design (torch's generator, not zeropp's hash), so
the error distribution is compared: unbiased, with a mean squared error
within 10% of the Rust kernels'.

Run on CPU tensors (the device path is written for GPUs, where the project
has no torch to run it):

    python -m unittest python/tests/test_torch_kernels.py
"""

from __future__ import annotations

import contextlib
import itertools
import os
import unittest

import numpy as np
import torch

import zeropp
from zeropp import _zeropp
from zeropp.torch import kernels as K
from zeropp.torch.stages import TorchQgzStages

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _data(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gradient-like values with outliers, an all-zero stretch and a tiny one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    x[n // 3: n // 3 + 40] = 0.0
    x[n // 2: n // 2 + 40] *= 1e-30
    x[::97] *= 50.0
    return x.to(dtype)


def _rust_wire(x: torch.Tensor, bits: int, gs: int, seed=None, propagate=False) -> torch.Tensor:
    out = torch.zeros(K.encoded_len(x.numel(), bits, gs), dtype=torch.uint8)
    xb, dt = zeropp._as_buffer(x.contiguous(), "x")
    _zeropp.quantize(xb, out.numpy(), dtype=dt, bits=bits, group_size=gs, seed=seed, propagate=propagate)
    return out


@contextlib.contextmanager
def block_of(elements):
    """Runs the kernels with blocks of ``elements`` (None: the default), so the
    bitwise checks cover a row cut into many blocks, not one."""
    old = os.environ.get("ZEROPP_TORCH_BLOCK")
    if elements is None:
        os.environ.pop("ZEROPP_TORCH_BLOCK", None)
    else:
        os.environ["ZEROPP_TORCH_BLOCK"] = str(elements)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ZEROPP_TORCH_BLOCK", None)
        else:
            os.environ["ZEROPP_TORCH_BLOCK"] = old


# The default block (one block per row here) and a small one (many blocks of
# whole groups; one group a block at the larger group sizes).
BLOCKS = (None, 200)


def _rust_values(wire: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.float32)
    _zeropp.dequantize(wire.numpy(), out.numpy(), dtype="float32")
    return out


LENGTHS = (1, 2, 7, 255, 256, 257, 1000, 4099)
GROUPS = (1, 3, 64, 255, 256)


class Kernels(unittest.TestCase):
    def test_quantize_is_bitwise_the_rust_kernel(self):
        for n, gs, bits, dtype, blk in itertools.product(LENGTHS, GROUPS, (4, 8), _NAMES, BLOCKS):
            with self.subTest(n=n, group_size=gs, bits=bits, dtype=_NAMES[dtype], block=blk), block_of(blk):
                x = _data(n, n * 31 + gs, dtype)
                want = _rust_wire(x, bits, gs)
                got = K.quantize_rows(x[None], bits=bits, group_size=gs)[0]
                self.assertEqual(got.numel(), want.numel())
                bad = (got != want).nonzero()
                self.assertEqual(bad.numel(), 0, f"first differing byte at {bad[:1].tolist()}")

    def test_dequantize_is_bitwise_the_rust_kernel(self):
        for n, gs, bits, blk in itertools.product(LENGTHS, GROUPS, (4, 8), BLOCKS):
            with self.subTest(n=n, group_size=gs, bits=bits, block=blk), block_of(blk):
                wire = _rust_wire(_data(n, n + gs), bits, gs)
                want = _rust_values(wire, n)
                got = K.dequantize_rows(wire[None], n, bits=bits, group_size=gs)[0]
                self.assertTrue(torch.equal(got.view(torch.int32), want.view(torch.int32)))

    def test_rows_are_independent_encodings(self):
        x = torch.stack([_data(301, s) for s in range(5)])
        rows = K.quantize_rows(x, bits=4, group_size=64)
        for i in range(5):
            self.assertTrue(torch.equal(rows[i], _rust_wire(x[i], 4, 64)))

    def test_stochastic_rounding_has_the_rust_error_distribution(self):
        n, gs = 1 << 16, 256
        x = _data(n, 7)
        g = K.generator(123, [0, 1], torch.device("cpu"))
        err_t = K.dequantize_rows(K.quantize_rows(x[None], bits=4, group_size=gs, generator=g),
                                  n, bits=4, group_size=gs)[0] - x
        err_r = _rust_values(_rust_wire(x, 4, gs, seed=123), n) - x
        near = K.dequantize_rows(K.quantize_rows(x[None], bits=4, group_size=gs), n, bits=4, group_size=gs)[0]
        # Each value rounds to one of its two neighbouring levels: never further than a step.
        step = (x.view(-1, gs).abs().amax(1) / 8).repeat_interleave(gs)
        self.assertTrue(bool((err_t.abs() <= step * (1 + 1e-6)).all()))
        ratio = float((err_t.double() ** 2).mean() / (err_r.double() ** 2).mean())
        self.assertTrue(0.9 < ratio < 1.1, f"MSE torch / Rust = {ratio:.3f}")
        # Unbiased: the mean error is far below the nearest-rounding error scale.
        rms_near = float(((near - x).double() ** 2).mean().sqrt())
        self.assertLess(abs(float(err_t.double().mean())), 0.02 * rms_near)
        self.assertFalse(torch.equal(err_t, near - x), "stochastic rounding changed nothing")

    def test_non_finite_input_poisons_its_group_as_the_rust_kernel(self):
        """NaN/±Inf: the group is poisoned (NaN scale, zero integers), byte for
        byte as the Rust kernels with ``propagate=True``; it decodes to NaN and
        the other groups decode as ever."""
        for n, gs, bits, blk in itertools.product((7, 1000, 4099), (3, 64, 256), (4, 8), BLOCKS):
            x = _data(n, n + gs)
            for i, v in ((0, float("nan")), (n // 2, float("inf")), (n - 1, float("-inf"))):
                x[i] = v
            with self.subTest(n=n, group_size=gs, bits=bits, block=blk), block_of(blk):
                want = _rust_wire(x, bits, gs, propagate=True)
                got = K.quantize_rows(x[None], bits=bits, group_size=gs)[0]
                self.assertTrue(torch.equal(got, want), "the poisoned encoding differs from Rust's")
                y = K.dequantize_rows(got[None], n, bits=bits, group_size=gs)[0]
                bad = torch.zeros(n, dtype=torch.bool)
                for i in (0, n // 2, n - 1):
                    bad[i // gs * gs:(i // gs + 1) * gs] = True
                self.assertTrue(torch.equal(y.isnan(), bad), "NaN exactly over the poisoned groups")
                self.assertTrue(torch.equal(y.view(torch.int32)[~bad], _rust_values(want, n).view(torch.int32)[~bad]))
        with self.assertRaises(zeropp.ZeroppError):
            _rust_wire(x, 4, 64)  # the Rust default still refuses it

    def test_corrupt_encodings_decode_to_nan(self):
        """No host read-back: a header that is not the expected one makes its
        whole row NaN, a bad scale its group; a wrong length (a host-side
        shape) is still an error."""
        wire = K.quantize_rows(torch.ones(2, 10), bits=8, group_size=4)
        clean = K.dequantize_rows(wire, 10, bits=8, group_size=4)
        for at, value, row_nan in ((0, 0, True), (6, 4, True), (K.HEADER + 3, 0xFF, False)):
            bad = wire.clone()
            bad[0, at] = value
            with self.subTest(byte=at):
                y = K.dequantize_rows(bad, 10, bits=8, group_size=4)
                want = torch.zeros(10, dtype=torch.bool)
                want[:10 if row_nan else 4] = True
                self.assertTrue(torch.equal(y[0].isnan(), want))
                self.assertTrue(torch.equal(y[1], clean[1]), "the other row is intact")
                self.assertTrue(torch.equal(y[0][~want], clean[0][~want]), "the other groups are intact")
        with self.assertRaises(zeropp.ZeroppError):
            K.dequantize_rows(wire, 11, bits=8, group_size=4)


class Hadamard(unittest.TestCase):
    """``hadamard_rows`` (torch ops) against the Rust rotation, bit for bit."""

    def test_rotation_is_bitwise_the_rust_kernel(self):
        for n, g, pos, inverse, blk in itertools.product((1, 7, 64, 200, 1000, 4099), (1, 2, 8, 64, 256),
                                                          (0, 5, 31, (1 << 37) - 100), (False, True), BLOCKS):
            x = _data(n, n + g)
            want = x.clone()
            _zeropp.hadamard(want.numpy(), group_size=g, seed=77 + g, position=pos, inverse=inverse)
            with block_of(blk):
                got = K.hadamard_rows(x[None], group_size=g, seed=77 + g, positions=[pos], inverse=inverse)[0]
            with self.subTest(n=n, g=g, pos=pos, inverse=inverse, block=blk):
                self.assertTrue(torch.equal(got.view(torch.int32), want.view(torch.int32)))

    def test_rotation_on_either_kernels_is_the_same(self):
        # rotate_on's Rust path (CPU tensors, ZEROPP_TORCH_KERNELS unset or auto)
        # against the torch ops, on column slices of rows that start at their
        # own stream positions, as qgZ's per-parameter rotation cuts them.
        x = torch.stack([_data(1300, 5), _data(1300, 6), _data(1300, 7)])
        old = os.environ.pop("ZEROPP_TORCH_KERNELS", None)
        try:
            for g, (a, b), inverse in itertools.product((8, 256), ((0, 1300), (37, 37 + 1024), (300, 1299)),
                                                        (False, True)):
                starts = [p * 1300 + a for p in range(3)]
                want = K.rotate(x[:, a:b], group_size=g, seed=11, starts=starts, inverse=inverse)
                got = K.rotate_on(x[:, a:b], group_size=g, seed=11, starts=starts, inverse=inverse)
                with self.subTest(g=g, cols=(a, b), inverse=inverse):
                    self.assertFalse(torch.equal(got, x[:, a:b]), "the rotation acted")
                    self.assertTrue(torch.equal(got.view(torch.int32), want.view(torch.int32)))
        finally:
            if old is not None:
                os.environ["ZEROPP_TORCH_KERNELS"] = old

    def test_rows_start_at_their_own_positions_and_come_back(self):
        x = torch.stack([_data(300, 1), _data(300, 2)])
        y = K.hadamard_rows(x, group_size=32, seed=3, positions=[0, 300])
        one = x.reshape(1, 600)
        # Row 1 at position 300 is the second half of one row of 600 (300 = 9·32 + 12:
        # an unaligned start), its 9 whole groups counted from its own start.
        whole = K.hadamard_rows(x[1:], group_size=32, seed=3, positions=[300])
        self.assertTrue(torch.equal(y[1], whole[0]))
        back = K.hadamard_rows(y, group_size=32, seed=3, positions=[0, 300], inverse=True)
        self.assertLess(float((back - x).abs().max()), 1e-5 * float(x.abs().max()))
        self.assertFalse(torch.equal(y[0], one[0, :300]))
        with self.assertRaises(_zeropp.ZeroppError):
            K.hadamard_rows(x, group_size=48, seed=3, positions=[0, 0])


class Docs(unittest.TestCase):
    def test_the_module_docstring_example_runs(self):
        import doctest

        result = doctest.testmod(K)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


def _run_qgz(make, nodes: int, local: int, n: int, seed, mean: bool, grads, **options):
    """A whole qgZ reduce-scatter over ``nodes x local`` ranks in one process:
    every rank's stages, with the two all-to-alls done by hand. Returns each
    rank's (intra_send, inter_send, shard). ``options`` go to the stages
    (``group_size``, ``intra_bits``, ``hadamard``)."""
    w = nodes * local
    kw = dict(bits=4, group_size=255, local_bits=8, seed=seed, mean=mean)
    kw.update(options)
    st = [make(w, local, r, n, **kw) for r in range(w)]
    bufs = []
    for r in range(w):
        s = st[r]
        b = dict(intra=torch.zeros(local * s.intra_chunk_len, dtype=torch.uint8),
                 own=torch.zeros(s.own_len, dtype=torch.uint8),
                 inter=torch.zeros(nodes * s.inter_chunk_len, dtype=torch.uint8),
                 shard=torch.zeros(s.shard_len, dtype=torch.float32))
        bufs.append(b)
    arg = (lambda t: t.numpy()) if make is _zeropp.QgzStages else (lambda t: t)
    for r in range(w):
        b = bufs[r]
        st[r].pack(arg(grads[r]), arg(b["intra"]), arg(b["own"]), arg(b["inter"]), arg(b["shard"]))
    sent_intra = [b["intra"].clone() for b in bufs]
    ci = st[0].intra_chunk_len
    for r in range(w):
        m, j = divmod(r, local)
        b = bufs[r]
        if ci:
            recv = torch.cat([sent_intra[m * local + k][j * ci:(j + 1) * ci] for k in range(local)])
            st[r].reduce_intra(arg(recv), arg(b["own"]), arg(b["inter"]), arg(b["shard"]))
    ce = st[0].inter_chunk_len
    sent_inter = [b["inter"].clone() for b in bufs]
    for r in range(w):
        m, j = divmod(r, local)
        recv = torch.cat([sent_inter[mm * local + j][m * ce:(m + 1) * ce] for mm in range(nodes)]) if ce \
            else torch.zeros(0, dtype=torch.uint8)
        st[r].finish(arg(recv), arg(bufs[r]["shard"]))
    return [(sent_intra[r], sent_inter[r], bufs[r]["shard"]) for r in range(w)]


class QgzStages(unittest.TestCase):
    SHAPES = ((2, 2), (2, 3), (1, 4), (4, 1), (3, 2))

    def test_the_torch_stages_are_bitwise_the_rust_stages(self):
        for (nodes, local), n, mean, blk in itertools.product(self.SHAPES, (1, 511, 2049), (True, False),
                                                              BLOCKS):
            w = nodes * local
            grads = [_data(n, 100 * r + n) for r in range(w)]
            with self.subTest(nodes=nodes, local=local, n=n, mean=mean, block=blk):
                want = _run_qgz(_zeropp.QgzStages, nodes, local, n, None, mean, grads)
                with block_of(blk):
                    got = _run_qgz(TorchQgzStages, nodes, local, n, None, mean, grads)
                for r in range(w):
                    for what, a, b in zip(("intra_send", "inter_send", "shard"), got[r], want[r]):
                        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                        self.assertTrue(same, f"rank {r}: {what} differs")

    def test_two_level_hadamard_stages_are_bitwise_the_rust_stages(self):
        """SDP4Bit's options (INT8 inside the node, INT4 across, every group
        rotated): the same bytes and shards as the Rust stages."""
        for (nodes, local), n in itertools.product(self.SHAPES, (1, 700, 4099)):
            w = nodes * local
            grads = [_data(n, 300 * r + n) for r in range(w)]
            opts = dict(group_size=64, intra_bits=8, hadamard=12345 + n)
            with self.subTest(nodes=nodes, local=local, n=n), block_of(200):
                want = _run_qgz(_zeropp.QgzStages, nodes, local, n, None, True, grads, **opts)
                got = _run_qgz(TorchQgzStages, nodes, local, n, None, True, grads, **opts)
                for r in range(w):
                    for what, a, b in zip(("intra_send", "inter_send", "shard"), got[r], want[r]):
                        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                        self.assertTrue(same, f"rank {r}: {what} differs")
                # And it reduces: within INT4 of the float64 mean (a loose bound;
                # the collective test checks the analytic one).
                exact = torch.stack([g.double() for g in grads]).mean(0)
                full = torch.cat([o[2] for o in got])[:n].double()
                scale = float(exact.abs().max()) + 1e-30
                self.assertLess(float((full - exact).abs().max()) / scale, 0.5)

    def test_stochastic_stages_stay_within_the_rust_error(self):
        nodes, local, n = 2, 2, 20000
        w = nodes * local
        grads = [_data(n, 5 + r) for r in range(w)]
        exact = torch.stack([g.double() for g in grads]).mean(0)
        errs = {}
        for make in (_zeropp.QgzStages, TorchQgzStages):
            out = _run_qgz(make, nodes, local, n, 99, True, grads)
            s = out[0][2].numel()
            full = torch.cat([o[2] for o in out])[:n].double()
            errs[make] = float(((full - exact) ** 2).mean())
            self.assertEqual(s, -(-n // w))
        ratio = errs[TorchQgzStages] / errs[_zeropp.QgzStages]
        self.assertTrue(0.8 < ratio < 1.25, f"MSE torch / Rust = {ratio:.3f}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    unittest.main()
