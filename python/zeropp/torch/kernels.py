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
equal the Rust kernels' (``python/tests/test_torch_kernels.py`` checks it, at
odd lengths, for INT8 and INT4); stochastic rounding draws its uniforms from
torch's generator instead of zeropp's hash, so it has the same error
distribution but other bits.

Three rules make these kernels fit a training step at real size:

- **Non-finite values propagate.** A group holding NaN or ±Inf is encoded
  as *poisoned*, as the Rust kernels do with ``propagate=True``: its scale
  is NaN and its integers 0, so it decodes to NaN, and a sum it enters is
  poisoned in turn. FSDP2's contract is kept (the non-finite gradient
  reaches the rank that owns it, whose own check then skips the step), and
  nothing is checked on the host.
- **No host synchronisation.** Nothing here reads a device value back
  (``item``, ``bool``, ``tolist``): a mismatched header or a scale that is
  neither finite-positive nor the poison decodes to NaN instead of raising,
  so a corrupt payload shows up where the user already looks (a non-finite
  gradient norm), and the device never waits for the host.
- **Bounded temporaries.** Work is done in column blocks of at most
  :data:`BLOCK` float32 elements (``ZEROPP_TORCH_BLOCK`` overrides it), so
  quantizing a 100M-parameter module's gradient costs a few blocks of
  scratch, not several copies of the gradient.

Which kernels run is the environment's choice, ``ZEROPP_TORCH_KERNELS``:

- ``auto`` (the default): the Rust kernels for CPU tensors, these for others;
- ``torch``: these everywhere (how the device path is tested on a CPU);
- ``rust``: the Rust kernels everywhere (device tensors staged through host
  memory).

This path has been run on CPU tensors only: the project's GPU machine has
no PyPI, so no torch, and it has not been run on a GPU.

>>> import torch
>>> from zeropp.torch import kernels
>>> x = torch.linspace(-1, 1, 1001)
>>> wire = kernels.quantize_rows(x[None], bits=4, group_size=128)
>>> y = kernels.dequantize_rows(wire, 1001, bits=4, group_size=128)
>>> bool((x - y[0]).abs().max() <= 1 / 8)
True
>>> x[5] = float("inf")                  # a non-finite value poisons its group
>>> y = kernels.dequantize_rows(kernels.quantize_rows(x[None], bits=4, group_size=128), 1001, bits=4,
...                             group_size=128)
>>> bool(y[0, :128].isnan().all()), bool(y[0, 128:].isfinite().all())
(True, True)
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from .. import _zeropp
from . import _env

HEADER = 32
_F32_MAX = torch.finfo(torch.float32).max
_MODES = ("auto", "torch", "rust")
#: The bits of a poisoned group's scale: the canonical quiet NaN of float32
#: (``zeropp_quant::wire::POISON_BITS``).
POISON_BITS = 0x7FC00000
#: The most float32 elements a block of work holds (16 MiB), unless
#: ``ZEROPP_TORCH_BLOCK`` says otherwise.
BLOCK = 1 << 22


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


def block() -> int:
    """Elements per block of work: ``ZEROPP_TORCH_BLOCK`` or :data:`BLOCK`."""
    b = _env.count("ZEROPP_TORCH_BLOCK", "elements")
    return BLOCK if b is None else b


def encoded_len(n: int, bits: int, group_size: int) -> int:
    """Bytes of one encoding of ``n`` elements (the Rust ``encoded_len``)."""
    return _zeropp.encoded_len(n, bits=bits, group_size=group_size)


@lru_cache(maxsize=256)
def _header(n: int, bits: int, group_size: int, device: torch.device) -> torch.Tensor:
    h = _zeropp.wire_header(n, bits=bits, group_size=group_size)
    return torch.frombuffer(bytearray(h), dtype=torch.uint8).to(device)


@lru_cache(maxsize=16)
def _nan(device: torch.device) -> torch.Tensor:
    return torch.tensor(float("nan"), dtype=torch.float32, device=device)


def _groups(n: int, group_size: int) -> int:
    return -(-n // group_size)


def _check_format(bits: int, group_size: int):
    if bits not in (4, 8):
        raise _zeropp.ZeroppError(f"bits must be 4 or 8, got {bits}")
    if group_size < 1:
        raise _zeropp.ZeroppError(f"group_size must be at least 1, got {group_size}")


def _width(rows: int, n: int, group_size: int) -> int:
    """Columns per block for ``rows`` rows: whole groups (pairs of groups when
    the group size is odd, so an INT4 block starts on a byte), about
    :func:`block` elements in all, at least one unit."""
    unit = group_size if group_size % 2 == 0 else 2 * group_size
    per_row = max(1, block() // max(rows, 1))
    return max(unit, per_row // unit * unit)


def blocks(rows: int, n: int, group_size: int):
    """The column ranges ``(a, b)`` a row of ``n`` elements is worked in."""
    w = _width(rows, n, group_size)
    return [(a, min(n, a + w)) for a in range(0, n, w)]


class Encoder:
    """Writes the wire encodings of ``out`` (``[rows, encoded_len(n)]``
    uint8, a view is fine) one column block at a time: construct it (the
    headers are written), then :meth:`put` each block's float32 values."""

    def __init__(self, out: torch.Tensor, n: int, *, bits: int, group_size: int):
        _check_format(bits, group_size)
        e = encoded_len(n, bits, group_size)
        if out.dim() != 2 or out.shape[1] != e:
            raise _zeropp.ZeroppError(f"an encoding of {n} elements at INT{bits} has {e} bytes, got "
                                      f"{tuple(out.shape)}")
        self.out, self.n, self.bits, self.gs = out, n, bits, group_size
        self.g = _groups(n, group_size)
        self.data = HEADER + 4 * self.g
        out[:, :HEADER] = _header(n, bits, group_size, out.device)

    def put(self, a: int, v: torch.Tensor, generator: torch.Generator | None = None):
        """Quantizes ``v`` (``[rows, m]`` float32: columns ``a..a+m``; ``a`` a
        block start of :func:`blocks`) into its scales and integers.
        ``generator`` turns on stochastic rounding."""
        rows, m = v.shape
        gs, half = self.gs, float(1 << (self.bits - 1))
        ga, gc = a // gs, _groups(m, gs)
        if gc * gs == m:
            vp = v.reshape(rows, gc, gs)
        else:
            vp = torch.nn.functional.pad(v, (0, gc * gs - m)).view(rows, gc, gs)
        amax = vp.abs().amax(dim=2)
        # NaN or Inf anywhere in the group: a poisoned group (NaN scale, zero integers).
        bad = ~torch.isfinite(amax)
        s = torch.where(amax == 0, torch.ones_like(amax), half / amax).clamp(max=_F32_MAX)
        scale = torch.where(bad, _nan(v.device), 1.0 / s)
        # A poisoned group's s is 0 (its products NaN), every other product finite
        # (|x·s| <= half): zeroing the NaNs zeroes exactly the poisoned groups.
        y = vp * torch.where(bad, 0.0, s)[:, :, None]
        y.nan_to_num_(nan=0.0)
        if generator is None:
            y.round_()
        else:
            # floor(y + u), u uniform in [0, 1): y rounds up with probability frac(y).
            y.add_(torch.rand(y.shape, generator=generator, device=v.device, dtype=torch.float32)).floor_()
        q = y.clamp_(-half, half - 1).to(torch.int8).view(rows, gc * gs)[:, :m]
        self.out[:, HEADER + 4 * ga:HEADER + 4 * (ga + gc)] = scale.view(torch.uint8)
        if self.bits == 8:
            self.out[:, self.data + a:self.data + a + m] = q.view(torch.uint8)
        else:
            u4 = torch.nn.functional.pad(q, (0, m % 2)).view(torch.uint8) & 0x0F
            self.out[:, self.data + a // 2:self.data + a // 2 + -(-m // 2)] = (u4[:, 0::2] << 4) | u4[:, 1::2]


def decode(wire: torch.Tensor, n: int, a: int, b: int, *, bits: int, group_size: int) -> torch.Tensor:
    """Columns ``a..b`` (``a`` a block start of :func:`blocks`) of the
    encodings ``wire`` (``[rows, encoded_len(n)]``) as float32 ``[rows, b-a]``.
    A row whose header is not the one for ``(n, bits, group_size)``, and a
    group whose scale is neither finite and positive nor the poison, decode to
    NaN: no host synchronisation, and nothing corrupt passes as a number."""
    _check_format(bits, group_size)
    rows, gs = wire.shape[0], group_size
    e = encoded_len(n, bits, gs)
    if wire.shape[1] != e:
        raise _zeropp.ZeroppError(
            f"dequantize: an encoding of {n} elements at INT{bits} has {e} bytes, got {wire.shape[1]}")
    m = b - a
    ga, gc = a // gs, _groups(m, gs)
    # A copy: scales inside a larger buffer need not sit on a 4-byte boundary.
    raw = wire[:, HEADER + 4 * ga:HEADER + 4 * (ga + gc)].clone(memory_format=torch.contiguous_format)
    scale = raw.view(torch.float32)
    ok = (scale > 0) & torch.isfinite(scale) | (raw.view(torch.int32) == POISON_BITS)
    ok &= (wire[:, :HEADER] == _header(n, bits, gs, wire.device)).all(dim=1, keepdim=True)
    scale = torch.where(ok, scale, _nan(wire.device))
    data = HEADER + 4 * _groups(n, gs)
    if bits == 8:
        q = wire[:, data + a:data + b].view(torch.int8)
    else:
        raw4 = wire[:, data + a // 2:data + a // 2 + -(-m // 2)]
        hi = raw4.view(torch.int8) >> 4
        lo = (raw4 << 4).view(torch.int8) >> 4
        q = torch.stack([hi, lo], dim=2).view(rows, -1)[:, :m]
    qf = q.to(torch.float32)
    if gc * gs == m:
        qp = qf.view(rows, gc, gs)
    else:
        qp = torch.nn.functional.pad(qf, (0, gc * gs - m)).view(rows, gc, gs)
    # q·scale + 0 as the Rust kernels: the + 0 changes nothing here (q·scale is
    # never -0: the scale is positive or NaN), so it is left out.
    return qp.mul_(scale[:, :, None]).view(rows, gc * gs)[:, :m]


def quantize_rows(x: torch.Tensor, *, bits: int, group_size: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Quantizes each row of ``x`` (``[rows, n]``, float32, bfloat16 or
    float16, any device) into one wire encoding: ``[rows, encoded_len(n)]``
    uint8 on ``x``'s device. ``generator`` (on that device) turns on
    stochastic rounding; without it, round-to-nearest-even. A group holding
    NaN or ±Inf is encoded as poisoned (it decodes to NaN)."""
    _check_format(bits, group_size)
    rows, n = x.shape
    out = torch.empty(rows, encoded_len(n, bits, group_size), dtype=torch.uint8, device=x.device)
    enc = Encoder(out, n, bits=bits, group_size=group_size)
    for a, b in blocks(rows, n, group_size):
        enc.put(a, x[:, a:b].to(torch.float32), generator)
    return out


def dequantize_rows(wire: torch.Tensor, n: int, *, bits: int, group_size: int) -> torch.Tensor:
    """Decodes ``[rows, encoded_len(n)]`` wire bytes into ``[rows, n]``
    float32 (see :func:`decode` for what a corrupt encoding gives)."""
    out = torch.empty(wire.shape[0], n, dtype=torch.float32, device=wire.device)
    for a, b in blocks(wire.shape[0], n, group_size):
        out[:, a:b] = decode(wire, n, a, b, bits=bits, group_size=group_size)
    return out


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


def hadamard_signs(seed: int, starts, count: int, device: torch.device) -> torch.Tensor:
    """The rotation's sign bits (bool ``[len(starts), count]``) at stream
    positions ``starts[r] + 0..count`` (Python ints): bit ``p mod 32`` of
    ``lowbias32(lowbias32(w ^ k1) ^ k2)`` for word ``w = p // 32``, ``(k1,
    k2)`` from ``splitmix64(seed ^ DOMAIN ^ splitmix64(w >> 32))``, as
    ``zeropp_quant::hadamard`` defines them. The key ranges are known on the
    host from ``starts``: no sort, no read-back."""
    starts = [int(p) for p in starts]
    pos = torch.as_tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(
        count, dtype=torch.int64, device=device)[None, :]
    words = pos >> 5
    his = range(min(starts) >> 37, ((max(starts) + max(count, 1) - 1) >> 37) + 1)
    out = None
    for hi in his:
        z = _splitmix64((seed ^ _SIGN_DOMAIN) ^ _splitmix64(hi))
        k1, k2 = z & _M32, z >> 32
        h = _lowbias32(_lowbias32((words & _M32) ^ k1) ^ k2)
        bit = ((h >> (pos & 31)) & 1).bool()
        out = bit if out is None else torch.where((words >> 32) == hi, bit, out)
    return out


def rotate(v: torch.Tensor, *, group_size: int, seed: int, starts, inverse: bool = False) -> torch.Tensor:
    """The randomized Hadamard rotation of every whole group of each row of
    ``v`` (``[rows, m]`` float32, row ``r`` starting at stream position
    ``starts[r]``); a partial last group is left as it is. The Rust kernels'
    operations in their order (flip, the butterfly stages ``h = 1, 2, ...``
    as ``(a + b, a - b)``, the multiply by ``1/sqrt(g)`` rounded to float32;
    the inverse: stages, multiply, flip), so the result is theirs bit for bit.
    Returns a new tensor."""
    g = group_size
    if g < 1 or g & (g - 1):
        raise _zeropp.ZeroppError(f"a Hadamard rotation needs a power-of-two group size, got {g}")
    rows, m = v.shape
    whole = m // g * g
    y = v.to(torch.float32, copy=True)
    if whole == 0:
        return y
    flip = hadamard_signs(seed, starts, whole, y.device)
    t = y[:, :whole]
    if not inverse:
        t = torch.where(flip, -t, t)
    t = t.reshape(rows, whole // g, g)
    h = 1
    while h < g:
        p = t.reshape(rows, -1, 2, h)
        a, b = p[:, :, 0, :], p[:, :, 1, :]
        t = torch.stack((a + b, a - b), dim=2).reshape(rows, whole // g, g)
        h *= 2
    t = t.reshape(rows, whole) * torch.tensor(1.0 / g ** 0.5, dtype=torch.float32, device=y.device)
    if inverse:
        t = torch.where(flip, -t, t)
    y[:, :whole] = t
    return y


def rotate_on(v: torch.Tensor, *, group_size: int, seed: int, starts, inverse: bool = False) -> torch.Tensor:
    """:func:`rotate` with the kernels :func:`use_torch` chooses for ``v``:
    these torch ops, or the Rust rotation row by row in host memory, which
    gives the same bits (``test_torch_kernels.Hadamard``) at a fraction of
    the CPU time. Returns a new float32 tensor."""
    if use_torch(v):
        return rotate(v, group_size=group_size, seed=seed, starts=starts, inverse=inverse)
    y = v.to(torch.float32, copy=True).contiguous()
    for r in range(y.shape[0]):
        _zeropp.hadamard(y[r].numpy(), group_size=group_size, seed=seed, position=int(starts[r]), inverse=inverse)
    return y


def hadamard_rows(x: torch.Tensor, *, group_size: int, seed: int, positions, inverse: bool = False) -> torch.Tensor:
    """:func:`rotate` of whole rows (``[rows, n]``, row ``r`` at stream position
    ``positions[r]``), done in column blocks of whole groups. Returns a new
    tensor."""
    g = group_size
    if g < 1 or g & (g - 1):
        raise _zeropp.ZeroppError(f"a Hadamard rotation needs a power-of-two group size, got {g}")
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    for a, b in blocks(rows, n, g):
        out[:, a:b] = rotate(x[:, a:b], group_size=g, seed=seed, starts=[p + a for p in positions],
                             inverse=inverse)
    return out
