""":class:`ByteCounter`: the bytes each rank hands torch.distributed, by node."""

from __future__ import annotations

import torch.distributed as dist


class ByteCounter:
    """Counts the bytes each rank hands to torch.distributed's collectives,
    split into those bound for ranks on this rank's node and those bound for
    other nodes (node = global rank // local_size).

    It wraps the module functions ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, ``all_to_all_single`` and ``all_reduce``, and
    on torch 2.15 and later ``all_gather_single`` and ``reduce_scatter_single``
    (FSDP2's default collectives and zeropp's call them through
    ``torch.distributed``), so it sees both. Per call, with ``b`` the input's bytes and ``G`` the group
    size: an all-gather sends ``b`` to each other member; a reduce-scatter and an
    all-to-all send ``b/G`` to each; an all-reduce counts as a reduce-scatter plus
    an all-gather (``2b/G`` to each)::

        with ByteCounter(local_size=2) as bc:
            loss.backward()
        bc.inter, bc.intra      # bytes this rank sent across / within nodes
    """

    # torch 2.15 renamed the single-tensor collectives (all_gather_single,
    # reduce_scatter_single; FSDP2 calls those) and kept the old names as
    # aliases that call the new ones inside torch (not through the patched
    # module attributes), so counting both names counts each call once.
    _NEW = ("all_gather_single", "reduce_scatter_single")
    _FUNCS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce") + tuple(
        f for f in _NEW if hasattr(dist, f))

    def __init__(self, local_size: int):
        self.local_size = local_size
        self.inter = 0
        self.intra = 0
        self.calls = {f: 0 for f in self._FUNCS}
        self._saved = {}

    def _count(self, name, group, per_member_bytes: float):
        members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        me = dist.get_rank()
        node = me // self.local_size
        for r in members:
            if r == me:
                continue
            if r // self.local_size == node:
                self.intra += int(per_member_bytes)
            else:
                self.inter += int(per_member_bytes)
        self.calls[name] += 1

    def __enter__(self):
        for name in self._FUNCS:
            self._saved[name] = getattr(dist, name)
        counter = self

        def all_gather_into_tensor(output, input, group=None, async_op=False):
            counter._count("all_gather_into_tensor", group, input.numel() * input.element_size())
            return counter._saved["all_gather_into_tensor"](output, input, group=group, async_op=async_op)

        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = dist.get_world_size(group)
            counter._count("reduce_scatter_tensor", group, input.numel() * input.element_size() / g)
            return counter._saved["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            if input_split_sizes is not None:
                raise NotImplementedError("ByteCounter counts equal-split all-to-alls only")
            g = dist.get_world_size(group)
            counter._count("all_to_all_single", group, input.numel() * input.element_size() / g)
            return counter._saved["all_to_all_single"](output, input, output_split_sizes, input_split_sizes,
                                                       group=group, async_op=async_op)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = dist.get_world_size(group)
            counter._count("all_reduce", group, 2 * tensor.numel() * tensor.element_size() / g)
            return counter._saved["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
            counter._count("all_gather_single", group, input_tensor.numel() * input_tensor.element_size())
            return counter._saved["all_gather_single"](output_tensor, input_tensor, group=group,
                                                       async_op=async_op)

        def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = dist.get_world_size(group)
            counter._count("reduce_scatter_single", group, input.numel() * input.element_size() / g)
            return counter._saved["reduce_scatter_single"](output, input, op=op, group=group, async_op=async_op)

        wrappers = (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, all_reduce,
                    all_gather_single, reduce_scatter_single)
        for f in wrappers:
            if f.__name__ in self._FUNCS:
                setattr(dist, f.__name__, f)
        return self

    def __exit__(self, *exc):
        for name, f in self._saved.items():
            setattr(dist, name, f)
        self._saved.clear()
        return False
