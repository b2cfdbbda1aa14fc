"""Sharding parameter pytrees: each leaf's partition is declared once, by path pattern.

    rules = (("layers.*.attn.qkv.weight", Partition(-2, "tp")), ...)
    local = shard(full_params, rules, {"tp": (rank, size)})      # this rank's slices
    full = unshard([local_0, local_1, ...], rules, "tp")         # back, from every rank's shards

Initialisation is "full, then slice": every layout holds slices of the same model, which is what
makes a run's numbers independent of the layout. A leaf matching no rule is replicated on that axis.
The experts' tensor-parallel axis "etp" is "tp" unless coords name it (Megatron's expert tensor
parallelism defaults to tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Sequence

import torch

from fmeg import tree


@dataclass(frozen=True)
class Partition:
    # counted from the end when negative, so stacked leaves ([2, F, H]) share a rule
    dim: int
    axis: str = "tp"


Rules = Sequence[tuple[str, Partition]]


def partition_of(path: str, rules: Rules, axis: str | None = None) -> Partition | None:
    """The first rule matching path (restricted to `axis` if given; "tp" also takes "etp" rules, the
    experts' default), or None (replicated)."""
    for pattern, part in rules:
        if fnmatchcase(path, pattern) and (
            axis is None or part.axis == axis or (axis, part.axis) == ("tp", "etp")
        ):
            return part
    return None


def splits(
    path: str, rules: Rules, coords: dict[str, tuple[int, int]]
) -> list[tuple[str, int, int, int]]:
    """(axis, dim, index, size) for each axis of coords (axis -> (index, size)) that splits the leaf
    at path, in the order shard cuts them. Without an "etp" entry the experts' "etp" leaves split
    over "tp"."""
    experts_apart = "etp" in coords
    out = []
    for axis, (index, size) in coords.items():
        part = partition_of(path, rules, axis)
        if part is None or size == 1 or (experts_apart and part.axis != axis):
            continue
        out.append((axis, part.dim, index, size))
    return out


def shard(params: Any, rules: Rules, coords: dict[str, tuple[int, int]]) -> Any:
    """This rank's slice of every partitioned leaf; coords maps axis -> (index, size)."""

    def take(path: str, leaf: torch.Tensor) -> torch.Tensor:
        for axis, dim, index, size in splits(path, rules, coords):
            if leaf.shape[dim] % size:
                raise ValueError(
                    f"{path}: dimension {dim} of size {leaf.shape[dim]} does not split over "
                    f"{axis}={size}"
                )
            leaf = leaf.chunk(size, dim=dim)[index]
        return leaf.contiguous()

    return tree.map_with_path(take, params)


def block_of(
    path: str, local_shape: Sequence[int], rules: Rules, coords: dict[str, tuple[int, int]]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, global shape): where a rank's slice of the leaf at path (of local_shape, cut by
    shard with these coords) sits in the full tensor."""
    offset, shape = [0] * len(local_shape), list(local_shape)
    # the last cut is the innermost
    for _, dim, index, size in reversed(splits(path, rules, coords)):
        dim %= len(local_shape)
        offset[dim] += index * shape[dim]
        shape[dim] *= size
    return tuple(offset), tuple(shape)


def unshard(shards: Sequence[Any], rules: Rules, axis: str) -> Any:
    """The full tree from every rank's shards along one axis (in rank order); replicated leaves are
    taken from rank 0 (checked equal to the others')."""

    def join(path: str, *leaves: torch.Tensor) -> torch.Tensor:
        part = partition_of(path, rules, axis)
        if part is None:
            return leaves[0]
        return torch.cat(leaves, dim=part.dim)

    return tree.map_with_path(join, shards[0], *shards[1:])
