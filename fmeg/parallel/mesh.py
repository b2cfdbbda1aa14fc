"""Rank groups as pure data, and a Mesh that binds them to communicators once.

    # {"tp": [[0, 1], [2, 3], ...], "pp": [[0, 4, 8, 12], ...], ...}
    groups = rank_groups(16, tp=2, pp=4)
    mesh = Mesh.from_torch_distributed(tp=2, pp=4)    # under torchrun
    # this rank's communicator and index on an axis
    mesh.group("tp"), mesh.coord("tp")

Ranks are laid out as Megatron lays them: the axes of `order` ("tp-cp-ep-dp-pp" by default) from
fastest to slowest varying, so rank = sum(coordinate[axis] * stride[axis]) with strides the prefix
products of the sizes. A group over a set of axes holds the ranks that differ only on those axes.
Attention layers see a decoder grid (tp, cp, dp, pp); expert layers an expert grid (expert_tp, ep,
expert_dp, pp) with the same pipeline groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
AXES = ("tp", "cp", "ep", "dp", "pp")


def _grid_groups(sizes: dict[str, int], order: list[str], spanned: list[str]) -> list[list[int]]:
    """Groups of ranks that differ only on the `spanned` axes; within a group, leftmost axis
    fastest."""
    strides, stride = {}, 1
    for axis in order:
        strides[axis] = stride
        stride *= sizes[axis]
    fixed = [a for a in order if a not in spanned]
    inner = [a for a in order if a in spanned]
    groups = []
    for outer in _mixed_radix([sizes[a] for a in fixed]):
        base = sum(i * strides[a] for i, a in zip(outer, fixed))
        groups.append(
            [
                base + sum(i * strides[a] for i, a in zip(pos, inner))
                for pos in _mixed_radix([sizes[a] for a in inner])
            ]
        )
    return groups


def _mixed_radix(sizes: list[int]) -> list[tuple[int, ...]]:
    """All index tuples over `sizes`, the first index varying fastest."""
    return [tuple(reversed(t)) for t in itertools.product(*(range(s) for s in reversed(sizes)))]


def _order_axes(order: str, sizes: dict[str, int]) -> list[str]:
    axes = order.lower().split("-")
    unknown = [a for a in axes if a not in AXES]
    if unknown or len(set(axes)) != len(axes):
        raise ValueError(f"order {order!r}: axes must be distinct names from {'-'.join(AXES)}")
    for axis, size in sizes.items():
        if axis not in axes:
            if size != 1:
                raise ValueError(
                    f"order {order!r} leaves out {axis}, whose size is {size}; add it to the order"
                )
            axes.append(axis)
    return axes


def rank_groups(
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    order: str = DEFAULT_ORDER,
    cp_a2a: int = 1,
    dp_outer: int = 1,
) -> dict[str, list[list[int]]]:
    """Every group Megatron's initialize_model_parallel builds, as lists of global ranks.

    Keys: tp, pp, dp, cp, dp_cp, mp (tp-pp), tp_cp, tp_dp, tp_dp_cp, embedding, position_embedding,
    ep, expert_tp, expert_dp, tp_ep, tp_ep_pp, and hierarchical context parallelism's two levels
    (Megatron's --hierarchical-context-parallel-sizes cp_a2a, cp / cp_a2a): cp_a2a, every cp_a2a
    consecutive ranks of a cp group, and cp_p2p, the ranks of a cp group cp_a2a apart; and hybrid
    sharding's two levels (Megatron's --num-distributed-optimizer-instances dp_outer): dp_cp_shard,
    every dp x cp / dp_outer consecutive ranks of a dp_cp group (an instance, which shards the
    state), and dp_cp_outer, the ranks of a dp_cp group that many apart (the instances' replicas);
    expert_dp_shard and expert_dp_outer split expert_dp alike.
    """
    etp = tp if etp is None else etp
    for name, size in dict(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp).items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world size {world_size} must be divisible by tp * pp * cp = {tp} * {pp} * {cp}"
        )
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} must be divisible by expert tp * ep * pp = {etp} * {ep} * "
            f"{pp}"
        )
    dp, expert_dp = world_size // (tp * pp * cp), world_size // (etp * ep * pp)

    decoder = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert = {"tp": etp, "cp": 1, "ep": ep, "dp": expert_dp, "pp": pp}
    d_order, e_order = _order_axes(order, decoder), _order_axes(order, expert)
    dec = lambda *axes: _grid_groups(decoder, d_order, list(axes))  # noqa: E731
    exp = lambda *axes: _grid_groups(expert, e_order, list(axes))  # noqa: E731

    groups = {
        "tp": dec("tp"),
        "pp": dec("pp"),
        "dp": dec("dp"),
        "cp": dec("cp"),
        "dp_cp": dec("dp", "cp"),
        "mp": dec("tp", "pp"),
        "tp_cp": dec("tp", "cp"),
        "tp_dp": dec("tp", "dp"),
        "tp_dp_cp": dec("tp", "dp", "cp"),
        "ep": exp("ep"),
        "expert_tp": exp("tp"),
        "expert_dp": exp("dp"),
        "tp_ep": exp("tp", "ep"),
        "tp_ep_pp": exp("tp", "ep", "pp"),
    }
    if exp("pp") != groups["pp"]:
        raise ValueError(
            "the decoder and expert grids give different pipeline groups; change the order"
        )
    if cp % cp_a2a:
        raise ValueError(
            f"the a2a level of hierarchical context parallelism ({cp_a2a}) must divide cp = {cp}"
        )
    groups["cp_a2a"] = [g[i : i + cp_a2a] for g in groups["cp"] for i in range(0, cp, cp_a2a)]
    groups["cp_p2p"] = [g[i::cp_a2a] for g in groups["cp"] for i in range(cp_a2a)]
    if dp_outer < 1 or (dp * cp) % dp_outer:
        raise ValueError(
            f"the distributed optimizer's instances ({dp_outer}) must divide dp x cp = {dp} x {cp}"
        )
    groups.update(_hybrid_groups(groups["dp_cp"], dp_outer, "dp_cp"))
    groups.update(_expert_hybrid_groups(groups["expert_dp"], dp_outer))
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in groups["pp"]]
    groups["position_embedding"] = [[g[0]] for g in groups["pp"]]
    return groups


def _expert_hybrid_groups(expert_dp: list[list[int]], instances: int) -> dict:
    """The experts' instances split expert_dp as the decoder's split dp_cp (megatron-core's intra-
    and inter-partial expert data-parallel groups); a grid they do not divide has none (the flags'
    check refuses it)."""
    if len(expert_dp[0]) % instances:
        return {}
    return _hybrid_groups(expert_dp, instances, "expert_dp")


def _hybrid_groups(data: list[list[int]], instances: int, name: str) -> dict[str, list[list[int]]]:
    """Megatron's intra- and inter-instance groups of each data-parallel group: {name}_shard,
    consecutive ranks, and {name}_outer, the ranks an instance apart."""
    inner = len(data[0]) // instances
    return {
        f"{name}_shard": [g[i * inner : (i + 1) * inner] for g in data for i in range(instances)],
        f"{name}_outer": [g[j::inner] for g in data for j in range(inner)],
    }


def group_of(groups: list[list[int]], rank: int) -> list[int] | None:
    """The group in `groups` holding `rank`, or None."""
    return next((g for g in groups if rank in g), None)


@dataclass
class Mesh:
    """This rank's view of the rank groups: for each group name, a communicator and a coordinate.

    Communicators follow fmeg.parallel.comm.Group; a group of one rank has communicator None, and
    every transform treats None as "no communication".
    """

    rank: int
    world_size: int
    sizes: dict[str, int]
    groups: dict[str, list[list[int]]]
    comms: dict[str, Any] = field(default_factory=dict)
    sequence_parallel: bool = False

    def size(self, name: str) -> int:
        return len(group_of(self.groups[name], self.rank) or [self.rank])

    def coord(self, name: str) -> int:
        """This rank's index inside its group `name`."""
        members = group_of(self.groups[name], self.rank)
        return members.index(self.rank) if members else 0

    def coord_of(self, name: str, rank: int) -> int:
        """Rank `rank`'s index inside its group `name`."""
        members = group_of(self.groups[name], rank)
        return members.index(rank) if members else 0

    def group(self, name: str) -> Any:
        """The communicator of this rank's group `name`, or None if the group has one rank."""
        return self.comms.get(name)

    @classmethod
    def build(
        cls, rank: int, world_size: int, make_comm, *, sequence_parallel: bool = False, **sizes: Any
    ) -> "Mesh":
        """A mesh whose communicators come from make_comm(ranks) for every group (all ranks call
        this in the same order, as torch.distributed.new_group requires)."""
        groups = rank_groups(world_size, **sizes)
        comms = {}
        for name, lists in groups.items():
            for ranks in lists:
                comm = make_comm(ranks) if len(ranks) > 1 else None
                if rank in ranks and comm is not None:
                    comms[name] = comm
        full = {k: sizes.get(k, 1) for k in ("tp", "pp", "cp", "ep")}
        full["dp"] = world_size // math.prod(full[k] for k in ("tp", "pp", "cp"))
        return cls(rank, world_size, full, groups, comms, sequence_parallel)

    @classmethod
    def single(cls) -> "Mesh":
        """One rank: every axis of size 1, no communication."""
        return cls.build(0, 1, lambda ranks: None)

    @classmethod
    def from_torch_distributed(
        cls,
        *,
        sequence_parallel: bool = False,
        device: Any = "cpu",
        timeout: Any = None,
        **sizes: Any,
    ) -> "Mesh":
        """A mesh over the initialised default process group (torchrun), with one new_group per
        group; device is where the groups' own buffers live (cuda:LOCAL_RANK under NCCL); timeout (a
        timedelta): how long a collective waits for a missing rank (torch's default for new groups
        is not the default group's)."""
        import torch.distributed as dist

        from fmeg.parallel.comm import TorchGroup

        rank, world = dist.get_rank(), dist.get_world_size()
        cache: dict[tuple, Any] = {}

        def make(ranks: list[int]) -> Any:
            key = tuple(ranks)
            if key not in cache:
                pg = dist.new_group(ranks, timeout=timeout)
                cache[key] = TorchGroup(pg, ranks.index(rank), device) if rank in ranks else None
            return cache[key]

        return cls.build(rank, world, make, sequence_parallel=sequence_parallel, **sizes)
