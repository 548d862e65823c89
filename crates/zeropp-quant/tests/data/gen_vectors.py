#!/usr/bin/env python3
"""Second implementation, in Python, behind zeropp-quant's fixed test vectors.

How `vectors.json` was produced:

    python3 crates/zeropp-quant/tests/data/gen_vectors.py > crates/zeropp-quant/tests/data/vectors.json

This is our own emulation of the quantization formula of DeepSpeed's kernels
(csrc/includes/quantization_utils.h), written from reading that source; it
does not run DeepSpeed, and its output was never compared with DeepSpeed's.
The stochastic-rounding RNG, the INT4 packing and the wire encoding below are
zeropp's own formats, not DeepSpeed's. See README.md in this folder.

Pure Python 3 (standard library only, no numpy). DeepSpeed's quantization
kernels compute in f32; this script emulates every f32 operation by computing in Python's double and rounding
the result to f32 with a `struct` round trip (`f32()` below). For +, -, *, /
of two f32 values, the double result rounded once to f32 equals the
correctly rounded f32 result (double has more than 2*24+2 bits), so this is
an exact emulation. Python's `round()` on floats rounds half to even, the
same as CUDA's `__float2int_rn` and Rust's `round_ties_even`.

Formats (see the crate docs):
  symmetric:  amax = max|x|; s = 2^(b-1)/amax (1 if amax == 0);
              q = clamp(round_even(x*s), -2^(b-1), 2^(b-1)-1); stored 1/s
  asymmetric: s = 2^b/(max-min) (1 if max == min); offset = (max+min)/2;
              q = clamp(round_even((x-offset)*s), ...); stored 1/s, offset
              (max and min get `+ 0.0` so that -0.0 becomes +0.0)
  INT4 packing: byte_k = (q_2k & 0xF) << 4 | (q_2k+1 & 0xF)
  stochastic: y = (x-offset)*s; f = floor(y); u = (h >> 8) * 2^-24 with
              h = lowbias32(lowbias32(lo ^ k1) ^ k2), (k1, k2) = halves of
              splitmix64(seed ^ splitmix64(index >> 32)), lo = index & 0xffffffff;
              q = clamp(f + (1 if u < y - f else 0))
  dequantize: x_hat = f32(f32(q * scale) + offset)

The wire encoding (version 1) is also emitted, header CRC-32C included.
"""

import json
import struct

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def lowbias32(x):
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform(seed, index):
    z = splitmix64(seed ^ splitmix64(index >> 32))
    k1, k2 = z & M32, z >> 32
    h = lowbias32(lowbias32((index & M32) ^ k1) ^ k2)
    return (h >> 8) * 2.0**-24


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def quantize(xs, nbits, scheme, group_size, seed=None):
    qmin, qmax = -(1 << (nbits - 1)), (1 << (nbits - 1)) - 1
    qs, scales, offsets = [], [], []
    for g0 in range(0, len(xs), group_size):
        grp = xs[g0 : g0 + group_size]
        if scheme == "sym":
            amax = max(abs(v) for v in grp)
            s = 1.0 if amax == 0 else f32(2.0 ** (nbits - 1) / amax)
            off = 0.0
        else:
            lo, hi = min(grp) + 0.0, max(grp) + 0.0
            s = 1.0 if hi == lo else f32(2.0**nbits / f32(hi - lo))
            off = f32(f32(hi + lo) / 2.0)
            offsets.append(off)
        scales.append(f32(1.0 / s))
        for i, v in enumerate(grp):
            y = f32(f32(v - off) * s)
            if seed is None:
                r = round(y)
            else:
                f = float(int(y // 1))
                frac = f32(y - f)
                r = f + 1 if uniform(seed, g0 + i) < frac else f
            qs.append(int(max(qmin, min(qmax, r))))
    return qs, scales, offsets


def pack(qs, nbits):
    if nbits == 8:
        return bytes(q & 0xFF for q in qs)
    out = bytearray()
    for k in range(0, len(qs), 2):
        lo = qs[k + 1] & 0xF if k + 1 < len(qs) else 0
        out.append(((qs[k] & 0xF) << 4) | lo)
    return bytes(out)


def dequantize(qs, scales, offsets, group_size):
    out = []
    for i, q in enumerate(qs):
        g = i // group_size
        off = offsets[g] if offsets else 0.0
        out.append(f32(f32(q * scales[g]) + off))
    return out


def wire(nbits, scheme, group_size, n, scales, offsets, data):
    payload = 4 * len(scales) + 4 * len(offsets) + len(data)
    head = b"ZPPQ" + struct.pack("<HBBIQQ", 1, nbits, 0 if scheme == "sym" else 1, group_size, n, payload)
    head += struct.pack("<I", crc32c(head))
    body = b"".join(struct.pack("<f", v) for v in scales + offsets)
    return head + body + data


class Lcg:
    def __init__(self, seed):
        self.state = seed

    def next(self):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & M64
        return self.state >> 33  # 31 bits

    def value(self, mag):
        return f32((self.next() / 2.0**31 * 2.0 - 1.0) * mag)


def case(name, nbits, scheme, group_size, xs, seed=None):
    xs = [f32(v) for v in xs]  # inputs are f32 values
    qs, scales, offsets = quantize(xs, nbits, scheme, group_size, seed)
    data = pack(qs, nbits)
    return {
        "name": name,
        "bits": nbits,
        "scheme": scheme,
        "group_size": group_size,
        "seed": seed,
        "input_bits": [bits(v) for v in xs],
        "q": qs,
        "data_hex": data.hex(),
        "scale_bits": [bits(v) for v in scales],
        "offset_bits": [bits(v) for v in offsets],
        "dequant_bits": [bits(v) for v in dequantize(qs, scales, offsets, group_size)],
        "wire_hex": wire(nbits, scheme, group_size, len(xs), scales, offsets, data).hex(),
    }


def main():
    rng = Lcg(20240607)
    # Group 0: ties at amax = 1 (s = 128): x*s = 1.5, 2.5, -0.5, -3.5, 126.5, 127.5.
    ties = [1.0, 1.5 / 128, 2.5 / 128, -0.5 / 128, -3.5 / 128, 126.5 / 128, 127.5 / 128, -1.0]
    zeros = [0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    mixed = [rng.value(3.0) for _ in range(21)]
    cases = [
        case("sym_int8_g8_ties_zeros_partial", 8, "sym", 8, ties + zeros + mixed),
        case("sym_int4_g5_odd_len", 4, "sym", 5, [rng.value(0.02) for _ in range(23)]),
        case("asym_int8_g16_const_group", 8, "asym", 16, [0.75] * 16 + [rng.value(5.0) + 2.0 for _ in range(24)]),
        case("asym_int4_g7", 4, "asym", 7, [rng.value(1.0) - 0.25 for _ in range(30)]),
        case("sym_int8_g16_stochastic", 8, "sym", 16, [rng.value(1.0) for _ in range(50)], seed=42),
        case("asym_int4_g9_stochastic", 4, "asym", 9, [rng.value(100.0) for _ in range(25)], seed=7),
        case("sym_int8_g1", 8, "sym", 1, [rng.value(10.0) for _ in range(5)] + [0.0]),
        case("empty", 8, "sym", 4, []),
    ]
    print(json.dumps({"generator": "gen_vectors.py", "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
