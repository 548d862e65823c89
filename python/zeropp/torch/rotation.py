"""qgZ's automatic rotation: which parameters' groups a Hadamard rotation pays for.

A randomized Hadamard rotation spreads each group's largest element over the
group. INT4's step is the group's largest magnitude over 7 (stochastic
rounding adds noise in proportion to its square), so the rotation lowers a
group's error where a few elements stand far above the rest (the MLP's down
projection, whose input channels carry the gated activations' outliers) and
raises it where the group is already flatter than a Gaussian one (at 99.5M
parameters the HF Llama's other projections, 0.107 to 0.121). Which side a
parameter falls on is read from its gradient: :class:`AutoRotation` compares
the sum of its groups' squared maxima before and after the rotation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import kernels as K

# The rotation is chosen where it cuts the squared group maxima (INT4's noise
# power) to less than this, on the mean of the measures so far. On the HF
# Llama the down projection's gradient gives 0.31 at 0.9M parameters and 0.17
# at 99.5M, every other projection 0.64-0.84 at 0.9M and 1.02-1.33 at 99.5M
# (docs/PERFORMANCE.md, "Error against model size").
GAIN = 0.5


class AutoRotation:
    """Chooses, per parameter of one FSDP2 module, whether qgZ rotates its
    groups (``qgz_hadamard="auto"``, :func:`zeropp.torch.enable`'s default).

    ``candidates`` holds one flag per segment of the module's layout: the
    parameters that may rotate (quantized ones, outside any embedding module).
    At the reduce-scatter's calls 1, 2, 4, 8, ... :meth:`measure` reads each
    candidate's gradient on this rank and sums the measure over the shard
    group (one all-reduce of two numbers per candidate, so every rank chooses
    the same); a parameter rotates while the mean of its measures so far is
    below :data:`GAIN` (one measure of a small parameter, a few groups, is
    noisy: the HF Llama's at width 128 swing by 0.2). The choice stays on the device until its copy to the host has
    arrived (:meth:`settle`; no collective waits on the host), and holds
    until the next measure. It changes no byte on the wire: it is a basis
    inside one collective, undone before the shard is written.
    """

    def __init__(self, candidates):
        self.candidates = tuple(bool(c) for c in candidates)
        # The choice the host knows, one flag per segment; none at first.
        self.chosen = tuple(False for _ in self.candidates)
        self.calls = 0
        # A measured choice on its way to the host: (segments, device flags,
        # host copy, the copy's event or None).
        self._pending = None
        # Per segment: the sum of its measures (a 0-d tensor on the device) and their count.
        self._sums, self._counts = {}, {}

    def due(self) -> bool:
        """Counts a call; true at calls 1, 2, 4, 8, ... (the choice is made
        log2(steps) times, so its cost vanishes as the run grows)."""
        self.calls += 1
        return self.calls & (self.calls - 1) == 0

    def measure(self, x2: torch.Tensor, quantized, carried, group_size: int,
                group: dist.ProcessGroup, device: torch.device):
        """Measures this call's gradient ``x2`` (``[world, c]``, FSDP2's
        rank-major input; ``quantized`` are the layout's ``(at, n, to)``
        entries and ``carried`` their segment indices) and starts the
        choice's copy to the host. Every rank of ``group`` must call it (it
        all-reduces, on ``device``: the input's, where the group's backend
        works). Parameters without a whole group keep their choice."""
        g = group_size
        picked = [(i, at, n // g * g) for i, (at, n, _) in zip(carried, quantized)
                  if self.candidates[i] and n >= g]
        if not picked:
            return
        stats = torch.zeros(len(picked), 2, dtype=torch.float64, device=x2.device)
        rows = x2.shape[0]
        for k, (_, at, whole) in enumerate(picked):
            cols = x2[:, at:at + whole].to(torch.float32)
            rot = K.rotate_on(cols, group_size=g, seed=0, starts=[0] * rows)
            stats[k, 0] = cols.reshape(rows, -1, g).abs().amax(-1).double().square().sum()
            stats[k, 1] = rot.reshape(rows, -1, g).abs().amax(-1).double().square().sum()
        stats = stats.to(device)
        dist.all_reduce(stats, group=group)
        # Each measure: the rotated sum over the raw one (1 where the gradient is zero).
        ratio = torch.where(stats[:, 0] > 0, stats[:, 1] / stats[:, 0].clamp_min(1e-300),
                            torch.ones_like(stats[:, 0]))
        means = []
        for k, (i, _, _) in enumerate(picked):
            self._sums[i] = ratio[k] if i not in self._sums else self._sums[i] + ratio[k]
            self._counts[i] = self._counts.get(i, 0) + 1
            means.append(self._sums[i] / self._counts[i])
        flags = torch.stack(means) < GAIN
        event = None
        if flags.device.type == "cuda":
            # Pinned, so that the copy runs behind the stream's work.
            host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flags.to("cpu")
        self._pending = ([i for i, _, _ in picked], flags, host, event)

    def settle(self) -> bool:
        """Takes in a measured choice whose copy has arrived; true when the
        host knows the current choice (:attr:`chosen`), false while it is
        still on the device (:meth:`device_flags`)."""
        if self._pending is None:
            return True
        picked, _, host, event = self._pending
        if event is not None and not event.query():
            return False
        chosen = list(self.chosen)
        # The copy has arrived: reading it waits on nothing.
        for i, v in zip(picked, host.numpy()):
            chosen[i] = bool(v)
        self.chosen = tuple(chosen)
        self._pending = None
        return True

    def device_flags(self, segments) -> list:
        """While the choice is on the device: for each segment index of
        ``segments``, its flag as a 0-d device tensor, or the host's
        choice where the measure did not cover it."""
        picked, flags, _, _ = self._pending
        at = {i: k for k, i in enumerate(picked)}
        return [flags[at[i]] if i in at else self.chosen[i] for i in segments]
