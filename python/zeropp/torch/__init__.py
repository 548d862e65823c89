"""ZeRO++ for PyTorch FSDP2: qwZ and qgZ as FSDP2's custom collectives.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets a module replace its
all-gather and reduce-scatter. This module fills those slots:

- :class:`QuantizedAllGather` (qwZ): each rank quantizes its shard to INT8
  (one scale per group of 256), the encodings travel through torch's
  ``all_gather_into_tensor``, and every rank dequantizes all of them, its own
  included, so all ranks compute with the same weights.
- :class:`QuantizedReduceScatter` (qgZ): the gradient's shards are reordered
  and quantized to INT4, exchanged inside the node (``all_to_all_single`` on a
  node sub-group), summed and requantized, exchanged once more over the rail
  (the ranks with the same local rank, one per node), and summed again. The
  stages are the Rust engine's own (``zeropp.QgzStages``): same slice order,
  same defaults (INT4 groups of 256 on the wire, INT8 for the chunk a rank
  keeps, stochastic rounding, 1-D parameters such as biases and norms reduced
  at their own precision).
- :class:`QuantizedAllReduce`: HSDP's replica all-reduce (the traffic that
  crosses nodes when each replica is a node) as two INT4 hops, through
  FSDP2's all-reduce hook on a model sharded over the shard dimension of the
  mesh (``enable(model, replicate=mesh["replicate"])``).
- hpZ inside zeropp's all-gather: for a module FSDP2 reshards fully after
  forward, each rank keeps the INT8 encodings of its node's share of the
  forward gather until the backward gather, which then runs inside the node
  and decodes them. A module sharded with ``reshard_after_forward=local_size``
  keeps FSDP2's own hpZ instead; ``enable(..., hpz=False)`` turns zeropp's off.

The transport is torch.distributed itself (gloo on CPU, NCCL on GPU): you keep
``torchrun`` and your process groups. Ranks must be numbered node by node
(rank = node * local_size + local rank), as torchrun does.

Four lines turn it on in an FSDP2 script (docs/pytorch.md has a complete one)::

    import zeropp.torch as zt
    local = zt.local_size()                       # ranks per node (torchrun's LOCAL_WORLD_SIZE)
    for block in model.blocks:
        fully_shard(block)                        # FSDP2 as usual
    fully_shard(model)
    zt.enable(model, local_size=local)            # qwZ + hpZ + qgZ

Kernels: CPU tensors go through zeropp's Rust kernels. Tensors on another
device (a GPU) are quantized, reduced and dequantized there, with torch ops
that follow the Rust kernels' formula (:mod:`zeropp.torch.kernels`; with
round-to-nearest their bytes are the Rust kernels'), so NCCL moves the INT8 and
INT4 payloads from device to device. ``ZEROPP_TORCH_KERNELS`` chooses: ``auto``
(the default), ``torch`` (the torch ops everywhere) or ``rust`` (everything
through host memory). The device path has been tested on CPU tensors only, not
on a GPU.
"""

from __future__ import annotations

import re as _re

# The oldest torch with FSDP2's custom collectives (FSDPModule.set_custom_all_gather
# and set_custom_reduce_scatter); pyproject.toml's `torch` extra asks for the same.
TORCH_FLOOR = (2, 9)
_FIX = "pip install 'torch>=2.9'"

try:
    import torch as _torch
except ModuleNotFoundError as _missing:
    # Only a missing torch; a torch that is there but fails to load (a missing
    # CUDA library) raises its own error, which names the real cause.
    if _missing.name != "torch":
        raise
    raise ImportError(f"zeropp.torch needs PyTorch >= 2.9, and torch is not installed: {_FIX}") from None
_found = _re.match(r"(\d+)\.(\d+)", getattr(_torch, "__version__", ""))
if _found is not None and (int(_found[1]), int(_found[2])) < TORCH_FLOOR:
    raise ImportError(
        f"zeropp.torch needs PyTorch >= 2.9 (FSDP2's custom collectives), this is torch "
        f"{_torch.__version__}: {_FIX}"
    )

from .allreduce import QuantizedAllReduce  # noqa: E402 (after the torch check, on purpose)
from .bytes import ByteCounter  # noqa: E402
from .collectives import QuantizedAllGather, QuantizedReduceScatter  # noqa: E402
from .enable import enable, retained_bytes, rotated  # noqa: E402
from .topology import Topology, local_size, release  # noqa: E402

__all__ = [
    "TORCH_FLOOR",
    "ByteCounter",
    "QuantizedAllReduce",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "Topology",
    "enable",
    "local_size",
    "release",
    "retained_bytes",
    "rotated",
]
