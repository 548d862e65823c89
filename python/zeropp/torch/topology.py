"""Nodes and rails of a process group: :func:`local_size` and :class:`Topology`."""

from __future__ import annotations

import torch.distributed as dist

from .. import _zeropp
from . import _env


def local_size() -> int:
    """Ranks per node: ``ZEROPP_LOCAL_SIZE`` when set (as for the Rust engine
    under mpirun; it lets one machine pose as several nodes), else torchrun's
    ``LOCAL_WORLD_SIZE``, else 1."""
    for var in ("ZEROPP_LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        n = _env.count(var, "ranks per node")
        if n is not None:
            return n
    return 1


class Topology:
    """A process group seen as nodes, with its sub-groups: one per node
    (intra-node) and one per position within a node (the rail). A rank's node
    is its global rank // ``local_size``; the group's members on each node must
    be consecutive in the group and equal in number (``self.local_size`` of
    them: ``local_size`` for a group of whole nodes, fewer for a group that
    takes part of each node, as HSDP's and FSDP + TP's shard groups do).

    Creating one is a collective call: every rank of the default group must
    create the same topologies in the same order (``torch.distributed.new_group``).
    Under HSDP (or FSDP + TP) each rank's shard group is a different one, so pass
    ``all_groups``, every shard group's ranks (the same list on every rank): the
    sub-groups of all of them are created on every rank, in one order.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, local_size: int | None = None, *,
                 all_groups=None):
        group = group if group is not None else dist.group.WORLD
        ls = local_size if local_size is not None else globals()["local_size"]()
        if ls < 1:
            raise _zeropp.ZeroppError(f"local_size {ls}: a node has at least one rank")
        ranks = list(dist.get_process_group_ranks(group))
        groups = [list(g) for g in all_groups] if all_groups is not None else [ranks]
        if ranks not in groups:
            raise _zeropp.ZeroppError(f"all_groups {groups} does not hold the group's ranks {ranks}")
        self.group = group
        self.ranks = ranks
        self.world = len(ranks)
        self.nodes, self.local_size = _node_layout(ranks, ls)
        me = dist.get_rank()
        self.rank = ranks.index(me) if me in ranks else -1
        self.intra = None
        self.rail = None
        # The sub-groups this rank is a member of (what release() destroys).
        self._members_of = []
        # Every rank creates every sub-group of every group, in the same order.
        layouts = [(g, _node_layout(g, ls)[1]) for g in groups]
        for g, per in layouts:
            for m in range(len(g) // per):
                members = g[m * per:(m + 1) * per]
                sub = dist.new_group(members)
                if me in members:
                    self._members_of.append(sub)
                    if g == ranks:
                        self.intra = sub
        for g, per in layouts:
            for j in range(per):
                members = g[j::per]
                sub = dist.new_group(members)
                if me in members:
                    self._members_of.append(sub)
                    if g == ranks:
                        self.rail = sub

    def node_of(self, global_rank: int) -> int:
        """The node of a member (by its position in the group), from 0."""
        return self.ranks.index(global_rank) // self.local_size

    def matches(self, group: dist.ProcessGroup) -> bool:
        """True when ``group`` has exactly this topology's ranks."""
        return dist.get_process_group_ranks(group) == self.ranks


# Topologies by (default group, local size, every shard group's ranks): what
# enable() reuses, so that enabling again (another model, or the same one
# after a change) creates no new sub-groups.
_CACHE: dict = {}


def shared_topology(group: dist.ProcessGroup, local_size: int, all_groups) -> Topology:
    """The :class:`Topology` of ``group`` among ``all_groups``, created on the
    first call (a collective call, on every rank in the same order) and
    reused by later calls with the same groups and local size, until
    :func:`release`."""
    groups = tuple(tuple(g) for g in all_groups)
    key = (id(dist.distributed_c10d._get_default_group()), local_size, groups)
    for cached in _CACHE.get(key, []):
        if cached.matches(group):
            return cached
    topo = Topology(group, local_size, all_groups=[list(g) for g in groups])
    _CACHE.setdefault(key, []).append(topo)
    return topo


def release() -> int:
    """Destroys the sub-groups that :func:`enable` created (every cached
    topology's node and rail groups this rank belongs to) and forgets them;
    returns how many groups it destroyed. Call it after training, before
    ``torch.distributed.destroy_process_group()``, when the process goes on
    (a notebook, several trainings in one job); a model enabled before it must
    be enabled again. Like creating groups, it is a collective call: every
    rank calls it."""
    destroyed = 0
    for topos in _CACHE.values():
        for topo in topos:
            for sub in topo._members_of:
                dist.destroy_process_group(sub)
                destroyed += 1
            topo._members_of = []
            topo.intra = topo.rail = None
    _CACHE.clear()
    return destroyed


def _node_layout(ranks, ls: int):
    """``(nodes, members per node)`` of a group whose ranks sit on nodes of
    ``ls`` ranks (node = global rank // ls): each node's members consecutive in
    the group and equal in number, or a :class:`ZeroppError` saying why not."""
    runs = []
    for r in ranks:
        node = r // ls
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        elif any(n == node for n, _ in runs):
            raise _zeropp.ZeroppError(
                f"the group's ranks {list(ranks)} visit node {node} (of {ls} ranks) twice: zeropp needs "
                f"each node's members consecutive in the group")
        else:
            runs.append([node, 1])
    per = {k for _, k in runs}
    if len(per) != 1:
        raise _zeropp.ZeroppError(
            f"the group's ranks {list(ranks)} take unequal numbers of ranks from the nodes of {ls} "
            f"({', '.join(f'node {n}: {k}' for n, k in runs)}); zeropp needs the same number on every node")
    return len(runs), per.pop()


def _shard_groups(mesh_info):
    """Every shard group of FSDP2's device mesh (the same list on every rank):
    one group for plain FSDP, one per replica under HSDP. A mesh that does not
    cover the world (a 1-D slice such as ``mesh["shard"]``, whose tensor holds
    this rank's row only) does not show the other ranks' groups, so they are
    gathered from every rank (a collective call, like the groups' creation)."""
    mesh = mesh_info.mesh.mesh
    dim = mesh_info.shard_mesh_dim
    if mesh.numel() == dist.get_world_size():
        return mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist()
    mine = list(dist.get_process_group_ranks(mesh_info.shard_process_group))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    groups = []
    for g in every:
        if g not in groups:
            groups.append(g)
    return groups


def _spans_nodes(group: dist.ProcessGroup, ls: int) -> bool:
    """True when the group's ranks sit on more than one node of ``ls`` ranks
    (node = global rank // ls)."""
    return len({r // ls for r in dist.get_process_group_ranks(group)}) > 1
