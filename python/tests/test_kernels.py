"""The kernels from Python are bit-identical to the Rust ones (issue 20, test 1).

The reference vectors come from the Rust crate itself
(`cargo run -p zeropp-quant --example golden_vectors -- DIR`); `cargo xtask
test-torch` writes them and passes DIR in ZEROPP_GOLDEN. Every case is run
through the Python package on numpy arrays and on torch tensors and must give
the same bytes: INT4 and INT8, symmetric and asymmetric, odd lengths and group
sizes, nearest and stochastic rounding, float32 and bfloat16 inputs.

Also checked: errors come back as zeropp.ZeroppError with the Rust message,
and the calls do not copy (outputs land in the caller's buffer).

    ZEROPP_GOLDEN=target/torch/golden python -m unittest python/tests/test_kernels.py
"""

from __future__ import annotations

import json
import os
import unittest

import numpy as np

import zeropp
from zeropp import _zeropp

try:
    import torch
except ImportError:  # the kernels do not need torch; the tensor cases do
    torch = None

GOLDEN = os.environ.get("ZEROPP_GOLDEN", "")


def _read(name: str) -> np.ndarray:
    with open(os.path.join(GOLDEN, name), "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8).copy()


@unittest.skipUnless(GOLDEN and os.path.isdir(GOLDEN), "ZEROPP_GOLDEN (the Rust reference vectors) is not set")
class GoldenVectors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(GOLDEN, "manifest.json")) as f:
            cls.cases = json.load(f)["cases"]

    def test_manifest_covers_the_formats(self):
        q = [c for c in self.cases if c["op"] == "quantize"]
        self.assertEqual({c["bits"] for c in q}, {4, 8})
        self.assertEqual({c["symmetric"] for c in q}, {True, False})
        self.assertTrue(any(c["n"] % 2 == 1 for c in q))
        self.assertTrue(any(c["seed"] is not None for c in q))
        self.assertEqual({c["dtype"] for c in q}, {"float32", "bfloat16"})
        self.assertTrue(any(c["op"] == "reduce" for c in self.cases))

    def test_quantize_and_dequantize_numpy(self):
        for c in (c for c in self.cases if c["op"] == "quantize"):
            with self.subTest(case=c):
                raw = _read(c["name"] + ".in")
                want = _read(c["name"] + ".wire")
                kw = dict(bits=c["bits"], group_size=c["group_size"], symmetric=c["symmetric"], seed=c["seed"])
                if c["dtype"] == "float32":
                    wire = zeropp.quantize(raw.view(np.float32), **kw)
                else:
                    # numpy has no bfloat16: the low-level call takes the bytes and a dtype name.
                    out = np.empty(zeropp.encoded_len(c["n"], bits=c["bits"], group_size=c["group_size"],
                                                      symmetric=c["symmetric"]), np.uint8)
                    zeropp._zeropp.quantize(raw.view(np.int16), out, dtype="bfloat16", **kw)
                    wire = out
                np.testing.assert_array_equal(wire, want)
                deq = zeropp.dequantize(want)
                np.testing.assert_array_equal(deq.view(np.uint32), _read(c["name"] + ".deq").view(np.uint32))

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_quantize_and_dequantize_tensors(self):
        for c in (c for c in self.cases if c["op"] == "quantize"):
            with self.subTest(case=c):
                raw = _read(c["name"] + ".in")
                want = _read(c["name"] + ".wire")
                if c["dtype"] == "float32":
                    x = torch.from_numpy(raw.view(np.float32).copy())
                else:
                    x = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
                out = torch.empty(len(want), dtype=torch.uint8)
                wire = zeropp.quantize(x, out, bits=c["bits"], group_size=c["group_size"],
                                       symmetric=c["symmetric"], seed=c["seed"])
                self.assertEqual(wire.data_ptr(), out.data_ptr())  # written in place, no copy
                np.testing.assert_array_equal(wire.numpy(), want)
                y = torch.empty(c["n"], dtype=torch.float32)
                zeropp.dequantize(out, y)
                np.testing.assert_array_equal(y.numpy().view(np.uint32), _read(c["name"] + ".deq").view(np.uint32))

    def test_fused_reduce(self):
        for c in (c for c in self.cases if c["op"] == "reduce"):
            with self.subTest(case=c):
                inputs = [_read(f"{c['name']}.in{i}") for i in range(c["inputs"])]
                got = zeropp.dequant_reduce_quant(inputs, bits=c["bits"], group_size=c["group_size"],
                                                  symmetric=c["symmetric"], seed=c["seed"])
                np.testing.assert_array_equal(got, _read(c["name"] + ".wire"))


class Docs(unittest.TestCase):
    def test_the_package_docstring_examples_run(self):
        import doctest

        result = doctest.testmod(zeropp)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)


class Errors(unittest.TestCase):
    def test_rust_messages_become_exceptions(self):
        x = np.ones(10, np.float32)
        # It prints as the package's own exception, not the extension module's.
        self.assertEqual(f"{zeropp.ZeroppError.__module__}.{zeropp.ZeroppError.__qualname__}", "zeropp.ZeroppError")
        with self.assertRaisesRegex(zeropp.ZeroppError, "group"):
            zeropp.quantize(x, group_size=0)
        with self.assertRaisesRegex(zeropp.ZeroppError, "bit width"):
            zeropp.quantize(x, bits=3)
        with self.assertRaises(zeropp.ZeroppError):
            zeropp.dequantize(np.zeros(40, np.uint8))  # no magic, no encoding
        wire = zeropp.quantize(x)
        bad = wire.copy()
        bad[9] ^= 1  # header checksum no longer matches
        with self.assertRaisesRegex(zeropp.ZeroppError, "(?i)crc|checksum"):
            zeropp.dequantize(bad)
        with self.assertRaisesRegex(zeropp.ZeroppError, "share memory"):
            zeropp._zeropp.quantize(x, x.view(np.uint8), dtype="float32")
        with self.assertRaisesRegex(zeropp.ZeroppError, "(?i)small|buffer"):
            zeropp.quantize(x, np.empty(8, np.uint8))
        with self.assertRaisesRegex(zeropp.ZeroppError, "read-only"):
            ro = np.empty(zeropp.encoded_len(10, bits=8), np.uint8)
            ro.flags.writeable = False
            zeropp.quantize(x, ro)
        with self.assertRaisesRegex(zeropp.ZeroppError, "(?i)non-finite|nan"):
            zeropp.quantize(np.array([1.0, np.nan], np.float32))
        with self.assertRaisesRegex(zeropp.ZeroppError, "contiguous"):
            zeropp._zeropp.quantize(np.ones(20, np.float32)[::2], np.empty(64, np.uint8), dtype="float32")

    @unittest.skipIf(torch is None, "torch is not installed")
    def test_enable_refuses_what_it_cannot_quantize(self):
        # Training on at full precision after a warning would hide the mistake.
        import zeropp.torch as zt
        with self.assertRaisesRegex(TypeError, "takes the model .* not a Tensor"):
            zt.enable(torch.zeros(3))
        with self.assertRaisesRegex(zeropp.ZeroppError, "no FSDP2 module.*fully_shard"):
            zt.enable(torch.nn.Linear(4, 4))  # before fully_shard

    def test_qgz_helpers(self):
        self.assertEqual(zeropp.qgz_slice_order(8, 4, 5), [[0, 4], [1, 5], [2, 6], [3, 7]])
        intra, inter = zeropp.qgz_wire_bytes(8, 4, 8 * 1024)
        e = zeropp.encoded_len(1024, bits=4)
        self.assertEqual((intra, inter), (3 * 2 * e, e))
        with self.assertRaises(zeropp.ZeroppError):
            zeropp.QgzStages(6, 4, 0, 100)  # 4 does not divide 6


class Segments(unittest.TestCase):
    """qwZ's one-call-per-collective tables equal one call per segment."""

    def _table(self, sizes, bits, gs, isz):
        table, at, off = [], 0, 0
        for k, exact in sizes:
            size = k * isz if exact else zeropp.encoded_len(k, bits=bits, group_size=gs)
            table.append((at, k, exact, off, size))
            at, off = at + k, off + size
        return table, at, off

    def test_tables_equal_calls_per_segment(self):
        rng = np.random.default_rng(3)
        sizes = [(1001, False), (37, True), (5, False), (256, False), (3, True), (1, False)]
        for bits, gs in ((8, 256), (4, 64), (4, 7)):
            table, n, e = self._table(sizes, bits, gs, 4)
            ranks = 3
            x = rng.standard_normal(n).astype(np.float32)
            send = np.zeros(e, np.uint8)
            _zeropp.quantize_segments(x, send, table, dtype="float32", bits=bits, group_size=gs)
            want = np.zeros(e, np.uint8)
            for at, k, exact, off, size in table:
                if exact:
                    want[off:off + size] = x[at:at + k].view(np.uint8)
                else:
                    _zeropp.quantize(x[at:at + k], want[off:off + size], dtype="float32", bits=bits,
                                     group_size=gs)
            self.assertTrue(np.array_equal(send, want), f"INT{bits}/{gs}: the send buffers differ")
            wire = np.concatenate([send] * ranks)
            out = np.full(ranks * n, np.nan, np.float32)
            _zeropp.dequantize_segments(wire, out, table, dtype="float32", bits=bits, group_size=gs,
                                        ranks=ranks, wire_stride=e, out_stride=n)
            ref = np.zeros(n, np.float32)
            for at, k, exact, off, size in table:
                if exact:
                    ref[at:at + k] = x[at:at + k]
                else:
                    _zeropp.dequantize(send[off:off + size], ref[at:at + k], dtype="float32")
            self.assertTrue(np.array_equal(out.view(np.uint32), np.tile(ref, ranks).view(np.uint32)))

    def test_bad_tables_are_errors(self):
        table, n, e = self._table([(100, False), (10, True)], 8, 32, 4)
        x, send = np.ones(n, np.float32), np.zeros(e, np.uint8)
        for bad in ([(0, 100, False, 0, table[0][4] - 1)], [(15, 100, False, 0, table[0][4])],
                    [(0, 10, True, e - 8, 40)]):
            with self.subTest(table=bad), self.assertRaises(zeropp.ZeroppError):
                _zeropp.quantize_segments(x, send, bad, dtype="float32", bits=8, group_size=32)
        _zeropp.quantize_segments(x, send, table, dtype="float32", bits=8, group_size=32)
        out = np.zeros(2 * n, np.float32)
        with self.assertRaises(zeropp.ZeroppError):  # a second rank past the end of the wire
            _zeropp.dequantize_segments(send, out, table, dtype="float32", bits=8, group_size=32, ranks=2,
                                        wire_stride=e, out_stride=n)
        broken = send.copy()
        broken[0] ^= 1  # the first encoding's magic
        with self.assertRaises(zeropp.ZeroppError):
            _zeropp.dequantize_segments(broken, out[:n], table, dtype="float32", bits=8, group_size=32)


if __name__ == "__main__":
    unittest.main()
