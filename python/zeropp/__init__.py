"""zeropp: ZeRO++'s quantized communication from a Rust core.

The kernels work on numpy arrays and on torch's CPU tensors without copies
(the GIL is released while they run). The wire format is zeropp's versioned
encoding (header, one scale per group, packed integers), the same bytes the
Rust engine sends.

>>> import numpy as np, zeropp
>>> x = np.linspace(-1, 1, 1000, dtype=np.float32)
>>> wire = zeropp.quantize(x, bits=4, group_size=128)
>>> len(wire) == zeropp.encoded_len(1000, bits=4, group_size=128)
True
>>> y = zeropp.dequantize(wire)
>>> bool(np.abs(x - y).max() <= 1 / 8)   # half an INT4 step of the group's range
True

`zeropp.torch` plugs qwZ and qgZ into PyTorch FSDP2 (see its docstring).
"""

from __future__ import annotations

import numpy as _np

from . import _zeropp
from ._zeropp import (
    __version__,
    QgzStages,
    ZeroppError,
    best_kernel,
    encoded_len,
    qgz_slice_order,
    qgz_wire_bytes,
    stream_seed,
    wire_info,
)

__all__ = [
    "__version__",
    "QgzStages",
    "ZeroppError",
    "best_kernel",
    "dequant_reduce_quant",
    "dequantize",
    "encoded_len",
    "qgz_slice_order",
    "qgz_wire_bytes",
    "quantize",
    "stream_seed",
    "wire_info",
]

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _as_buffer(x, name: str):
    """A zero-copy buffer-protocol view of a numpy array or a CPU torch tensor,
    and its element dtype name ("float32", "bfloat16", "float16", "uint8")."""
    if isinstance(x, _np.ndarray):
        if x.dtype == _np.float32:
            return x, "float32"
        if x.dtype == _np.float16:
            return x, "float16"
        if x.dtype == _np.uint8:
            return x, "uint8"
        raise ZeroppError(f"{name}: unsupported numpy dtype {x.dtype}; use float32, float16 or uint8")
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch

        if x.device.type != "cpu":
            raise ZeroppError(f"{name}: the kernels run on CPU tensors, got one on {x.device}")
        if not x.is_contiguous():
            raise ZeroppError(f"{name}: the tensor is not contiguous; call .contiguous() first")
        flat = x.detach().reshape(-1)
        if x.dtype == torch.float32:
            return flat.numpy(), "float32"
        if x.dtype == torch.float16:
            return flat.numpy(), "float16"
        if x.dtype == torch.bfloat16:
            # numpy has no bfloat16: hand over the same bytes as int16.
            return flat.view(torch.int16).numpy(), "bfloat16"
        if x.dtype == torch.uint8:
            return flat.numpy(), "uint8"
        raise ZeroppError(f"{name}: unsupported tensor dtype {x.dtype}")
    raise ZeroppError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


def _float_buffer(x, name: str):
    buf, dtype = _as_buffer(x, name)
    if dtype == "uint8":
        raise ZeroppError(f"{name}: expected float32, bfloat16 or float16 elements, got uint8")
    return buf, dtype


def _wire_buffer(x, name: str):
    buf, dtype = _as_buffer(x, name)
    if dtype != "uint8":
        raise ZeroppError(f"{name}: a wire encoding is a uint8 buffer, got {dtype}")
    return buf


def quantize(x, out=None, *, bits: int = 8, group_size: int = 256, symmetric: bool = True, seed: int | None = None):
    """Quantizes `x` (float32 / bfloat16 / float16; numpy or CPU tensor) into
    zeropp's wire encoding and returns it (a uint8 array, or `out` trimmed to
    the bytes written when `out` is given: a uint8 array or tensor of at least
    `encoded_len(x.size, ...)` bytes).

    Groups of `group_size` elements share one scale; `bits` is 4 or 8;
    `symmetric=False` adds one offset per group. `seed` turns on stochastic
    rounding (unbiased, deterministic for a seed); the default rounds to the
    nearest even.
    """
    buf, dtype = _float_buffer(x, "x")
    n = buf.size
    if out is None:
        out = _np.empty(encoded_len(n, bits=bits, group_size=group_size, symmetric=symmetric), dtype=_np.uint8)
    ob = _wire_buffer(out, "out")
    written = _zeropp.quantize(
        buf, ob, dtype=dtype, bits=bits, group_size=group_size, symmetric=symmetric, seed=seed
    )
    return out[:written]


def dequantize(wire, out=None, *, add: bool = False):
    """Dequantizes one wire encoding into `out` (float32 / bfloat16 / float16,
    as many elements as the encoding holds) or into a new float32 numpy array,
    and returns it. With `add=True` (float32 `out`) the values are added."""
    wb = _wire_buffer(wire, "wire")
    if out is None:
        if add:
            raise ZeroppError("dequantize(add=True) needs an `out` to add to")
        _, _, _, n = wire_info(wb)
        out = _np.empty(n, dtype=_np.float32)
    ob, dtype = _float_buffer(out, "out")
    _zeropp.dequantize(wb, ob, dtype=dtype, add=add)
    return out


def dequant_reduce_quant(inputs, out=None, *, bits: int = 4, group_size: int = 256, symmetric: bool = True,
                         seed: int | None = None):
    """The fused qgZ kernel: sums the dequantized `inputs` (wire encodings of
    equal element counts) in float32, in list order, and requantizes the sum.
    Returns the new encoding (or `out` trimmed to the bytes written)."""
    bufs = [_wire_buffer(w, f"inputs[{i}]") for i, w in enumerate(inputs)]
    if not bufs:
        raise ZeroppError("dequant_reduce_quant needs at least one input")
    if out is None:
        n = wire_info(bufs[0])[3]
        out = _np.empty(encoded_len(n, bits=bits, group_size=group_size, symmetric=symmetric), dtype=_np.uint8)
    ob = _wire_buffer(out, "out")
    written = _zeropp.dequant_reduce_quant(
        bufs, ob, bits=bits, group_size=group_size, symmetric=symmetric, seed=seed
    )
    return out[:written]
