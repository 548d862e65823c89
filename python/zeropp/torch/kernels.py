"""zeropp's quantization kernels in torch ops, for tensors off the CPU.

The Rust kernels (``zeropp._zeropp``) read and write host memory. For a
tensor on a GPU, copying it to the host and back would make ZeRO++ a
slowdown, so :mod:`zeropp.torch` quantizes, dequantizes and reduces such
tensors on their own device with the functions here, and NCCL moves the
INT8/INT4 payload from device to device.

They follow the Rust kernels' formula step by step, in float32 (symmetric
groups; ``half = 2^(bits-1)``)::

    amax  = max |x| over the group
    s     = 1 if amax == 0 else min(half / amax, f32::MAX)
    scale = 1 / s                                   (stored, one per group)
    q     = clamp(round_half_even(x * s), -half, half - 1)
    x'    = q * scale + 0                           (dequantized)

and write zeropp's wire format: the 32-byte header (from the Rust side, so
it is byte-for-byte the same), the scales, then the integers (INT4: element
``2k`` in the high nibble of byte ``k``). With round-to-nearest the bytes
equal the Rust kernels' (``python/tests/test_kernels.py`` checks it, at odd
lengths, for INT8 and INT4); stochastic rounding draws its uniforms from
torch's generator instead of zeropp's hash, so it has the same error
distribution but other bits.

Which kernels run is the environment's choice, ``ZEROPP_TORCH_KERNELS``:

- ``auto`` (the default): the Rust kernels for CPU tensors, these for others;
- ``torch``: these everywhere (how the device path is tested on a CPU);
- ``rust``: the Rust kernels everywhere (device tensors staged through host
  memory, as before this module existed).

This path has been run on CPU tensors only: the project's GPU machine has
no PyPI, so no torch, and it has not been run on a GPU.

>>> import torch
>>> from zeropp.torch import kernels
>>> x = torch.linspace(-1, 1, 1001)
>>> wire = kernels.quantize_rows(x[None], bits=4, group_size=128)
>>> y = kernels.dequantize_rows(wire, 1001, bits=4, group_size=128)
>>> bool((x - y[0]).abs().max() <= 1 / 8)
True
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from .. import _zeropp

HEADER = 32
_F32_MAX = torch.finfo(torch.float32).max
_MODES = ("auto", "torch", "rust")


def mode() -> str:
    """``ZEROPP_TORCH_KERNELS``, checked (``auto`` when unset)."""
    m = os.environ.get("ZEROPP_TORCH_KERNELS", "auto") or "auto"
    if m not in _MODES:
        raise _zeropp.ZeroppError(f"ZEROPP_TORCH_KERNELS={m!r}: use one of {', '.join(_MODES)}")
    return m


def use_torch(t: torch.Tensor) -> bool:
    """Whether the collectives quantize ``t`` with these torch ops (True) or
    with the Rust kernels (False), by :func:`mode` and ``t``'s device."""
    m = mode()
    return m == "torch" or (m == "auto" and t.device.type != "cpu")


def encoded_len(n: int, bits: int, group_size: int) -> int:
    """Bytes of one encoding of ``n`` elements (the Rust ``encoded_len``)."""
    return _zeropp.encoded_len(n, bits=bits, group_size=group_size)


@lru_cache(maxsize=256)
def _header(n: int, bits: int, group_size: int, device: torch.device) -> torch.Tensor:
    h = _zeropp.wire_header(n, bits=bits, group_size=group_size)
    return torch.frombuffer(bytearray(h), dtype=torch.uint8).to(device)


def _groups(n: int, group_size: int) -> int:
    return -(-n // group_size)


def quantize_rows(x: torch.Tensor, *, bits: int, group_size: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Quantizes each row of ``x`` (``[rows, n]``, float32, bfloat16 or
    float16, any device) into one wire encoding: ``[rows, encoded_len(n)]``
    uint8 on ``x``'s device. ``generator`` (on that device) turns on
    stochastic rounding; without it, round-to-nearest-even. A non-finite
    element is a :class:`zeropp.ZeroppError`, as in the Rust kernels."""
    if bits not in (4, 8):
        raise _zeropp.ZeroppError(f"bits must be 4 or 8, got {bits}")
    if group_size < 1:
        raise _zeropp.ZeroppError(f"group_size must be at least 1, got {group_size}")
    rows, n = x.shape
    dev = x.device
    g = _groups(n, group_size)
    v = x.to(torch.float32)
    if not bool(torch.isfinite(v).all()):
        raise _zeropp.ZeroppError("quantize: the input holds a non-finite value (inf or NaN)")
    vp = torch.nn.functional.pad(v, (0, g * group_size - n)).view(rows, g, group_size)
    amax = vp.abs().amax(dim=2)
    half = float(1 << (bits - 1))
    s = torch.where(amax == 0, torch.ones_like(amax), half / amax).clamp(max=_F32_MAX)
    scale = 1.0 / s
    y = vp * s[:, :, None]
    if generator is None:
        r = torch.round(y)
    else:
        f = torch.floor(y)
        u = torch.rand(y.shape, generator=generator, device=dev, dtype=torch.float32)
        r = torch.where(u < y - f, f + 1.0, f)
    q = r.clamp(-half, half - 1).to(torch.int8).view(rows, g * group_size)[:, :n]
    if bits == 8:
        data = q.view(torch.uint8)
    else:
        u4 = torch.nn.functional.pad(q, (0, n % 2)).view(torch.uint8) & 0x0F
        data = (u4[:, 0::2] << 4) | u4[:, 1::2]
    head = _header(n, bits, group_size, dev).expand(rows, HEADER)
    return torch.cat([head, scale.contiguous().view(torch.uint8), data], dim=1)


def dequantize_rows(wire: torch.Tensor, n: int, *, bits: int, group_size: int,
                    checks: list | None = None) -> torch.Tensor:
    """Decodes ``[rows, encoded_len(n)]`` wire bytes into ``[rows, n]``
    float32. Each row's header must be the one for ``(n, bits, group_size)``
    and its scales finite and positive: checked at once unless ``checks`` (a
    list) is given, which then collects the verdict as a bool tensor for
    :func:`raise_unless` (one device sync per collective instead of one per
    encoding)."""
    rows = wire.shape[0]
    g = _groups(n, group_size)
    e = encoded_len(n, bits, group_size)
    if wire.shape[1] != e:
        raise _zeropp.ZeroppError(
            f"dequantize: an encoding of {n} elements at INT{bits} has {e} bytes, got {wire.shape[1]}")
    head = _header(n, bits, group_size, wire.device)
    # A copy: the scales of an encoding inside a larger buffer need not sit on a
    # 4-byte boundary, which a float view needs (and they are few).
    scale = wire[:, HEADER:HEADER + 4 * g].clone(memory_format=torch.contiguous_format).view(torch.float32)
    ok = (wire[:, :HEADER] == head).all() & (scale > 0).all() & torch.isfinite(scale).all()
    if checks is None:
        raise_unless([ok], "dequantize")
    else:
        checks.append(ok)
    data = wire[:, HEADER + 4 * g:]
    if bits == 8:
        q = data.view(torch.int8)
    else:
        hi = data.view(torch.int8) >> 4
        lo = (data << 4).view(torch.int8) >> 4
        q = torch.stack([hi, lo], dim=2).view(rows, -1)[:, :n]
    qp = torch.nn.functional.pad(q.to(torch.float32), (0, g * group_size - n)).view(rows, g, group_size)
    return (qp * scale[:, :, None] + 0.0).view(rows, g * group_size)[:, :n]


def raise_unless(checks: list, what: str):
    """Raises :class:`zeropp.ZeroppError` unless every collected check holds."""
    if checks and not bool(torch.stack(checks).all()):
        raise _zeropp.ZeroppError(
            f"{what}: an encoding's header does not match its expected format, or a scale is not "
            f"finite and positive (a corrupt or mismatched payload)")


def sum_rows(wires, n: int, *, bits_of, group_size: int, checks: list) -> torch.Tensor:
    """The float32 sum, in list order from zero, of the dequantized encodings
    ``wires`` (each ``[rows, E]``; ``bits_of[i]`` is encoding ``i``'s width),
    as the Rust fused kernel adds them."""
    acc = None
    for w, b in zip(wires, bits_of):
        d = dequantize_rows(w, n, bits=b, group_size=group_size, checks=checks)
        acc = torch.zeros_like(d) + d if acc is None else acc.add_(d)
    return acc


def generator(seed: int | None, keys, device: torch.device) -> torch.Generator | None:
    """A generator for one stochastic-rounding stream (None: nearest), seeded
    from ``seed`` and ``keys`` with zeropp's own stream derivation."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(_zeropp.stream_seed(seed, list(keys)) & ((1 << 63) - 1))
    return g


# ---- the Hadamard rotation (zeropp_quant::hadamard), in torch ops -------------

_M64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
_SIGN_DOMAIN = 0x484144414D415244  # b"HADAMARD": the sign stream's own seeds


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for ``x`` holding u32 values in int64, without an
    int64 overflow (``c`` split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def hadamard_signs(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """The rotation's sign bits (bool) at stream ``positions`` (int64): bit
    ``p mod 32`` of ``lowbias32(lowbias32(w ^ k1) ^ k2)`` for word ``w = p //
    32``, ``(k1, k2)`` from ``splitmix64(seed ^ DOMAIN ^ splitmix64(w >> 32))``,
    as ``zeropp_quant::hadamard`` defines them."""
    words = positions >> 5
    out = torch.zeros(positions.shape, dtype=torch.bool, device=positions.device)
    for hi in torch.unique(words >> 32).tolist():
        z = _splitmix64((seed ^ _SIGN_DOMAIN) ^ _splitmix64(hi))
        k1, k2 = z & _M32, z >> 32
        sel = (words >> 32) == hi
        h = _lowbias32(_lowbias32((words & _M32) ^ k1) ^ k2)
        bit = ((h >> (positions & 31)) & 1).bool()
        out = torch.where(sel, bit, out)
    return out


def hadamard_rows(x: torch.Tensor, *, group_size: int, seed: int, positions, inverse: bool = False) -> torch.Tensor:
    """The randomized Hadamard rotation of every whole group of each row of
    ``x`` (``[rows, n]`` float32), row ``r`` starting at stream position
    ``positions[r]``; a partial last group is left as it is. The Rust kernels'
    operations in their order (flip, the butterfly stages ``h = 1, 2, ...``
    as ``(a + b, a - b)``, the multiply by ``1/sqrt(g)`` rounded to float32;
    the inverse: stages, multiply, flip), so the result is theirs bit for bit.
    Returns a new tensor."""
    g = group_size
    if g < 1 or g & (g - 1):
        raise _zeropp.ZeroppError(f"a Hadamard rotation needs a power-of-two group size, got {g}")
    rows, n = x.shape
    whole = n // g * g
    y = x.to(torch.float32, copy=True)
    if whole == 0:
        return y
    dev = y.device
    pos = torch.as_tensor(list(positions), dtype=torch.int64, device=dev)[:, None] + torch.arange(
        whole, dtype=torch.int64, device=dev)[None, :]
    flip = hadamard_signs(seed, pos)
    v = y[:, :whole]
    if not inverse:
        v = torch.where(flip, -v, v)
    v = v.reshape(rows, whole // g, g)
    h = 1
    while h < g:
        p = v.reshape(rows, -1, 2, h)
        a, b = p[:, :, 0, :], p[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2).reshape(rows, whole // g, g)
        h *= 2
    v = v.reshape(rows, whole) * torch.tensor(1.0 / g ** 0.5, dtype=torch.float32, device=dev)
    if inverse:
        v = torch.where(flip, -v, v)
    y[:, :whole] = v
    return y
