"""ZeRO-1, the distributed optimizer: optimizer state sharded over data-parallel ranks.

    # the local params as one fp32 vector, each unit padded to a multiple of dp
    flat = FlatBuffer.of(params, dp, unit_of)
    shard = flat.shard(flat.flatten(grads), rank)
    ...

Leaves lie in tree order. The buffer is cut into units (unit_of(path): a layer, the embedding; by
default one unit, the whole buffer), each padded to a multiple of dp, and every data-parallel rank
owns the rank-th 1/dp of every unit, as Megatron-FSDP and FSDP2 shard: a unit is gathered with one
all-gather and its gradient reduced with one reduce-scatter. This rank's owned elements, its chunks
of the units in order, are what the sliced buffers hold: owned position o_u + i is flat position
start_u + rank * chunk_u + i. Gradients are reduce-scattered (each rank receives the data-parallel
sum of its chunks), AdamW steps on them only (its two moments cost 8 / dp bytes per parameter in
fp32), and the updated chunks are all-gathered. The arithmetic per element is the replicated
optimizer's, so the loss curve is the same.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fmeg import tree


@dataclass(frozen=True)
class FlatBuffer:
    shapes: tuple[torch.Size, ...]
    spec: Any
    # the number of parameters (no padding)
    numel: int
    padded: int
    dp: int
    # each leaf's flat start
    starts: tuple[int, ...]
    # each unit's [start, end): end - start a multiple of dp
    units: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, params: Any, dp: int, unit_of: Callable[[str], str] | None = None) -> "FlatBuffer":
        """params: a tree (its leaves' shapes are read); unit_of(path): the unit of a leaf (units
        contiguous in tree order); None: one unit."""
        items = list(tree.items(params))
        _, spec = tree.tree_flatten(params)
        names = [unit_of(path) if unit_of else "" for path, _ in items]
        starts, units, position = [], [], 0
        for i, (path, leaf) in enumerate(items):
            if i and names[i] != names[i - 1]:
                if names[i] in names[:i]:
                    raise ValueError(f"FlatBuffer: unit {names[i]} is not contiguous (at {path})")
                position = -(-position // dp) * dp
                units.append(position)
            starts.append(position)
            position += leaf.numel()
        padded = -(-position // dp) * dp
        cuts = [0, *units, padded]
        return cls(
            tuple(leaf.shape for _, leaf in items),
            spec,
            sum(leaf.numel() for _, leaf in items),
            padded,
            dp,
            tuple(starts),
            tuple(zip(cuts, cuts[1:])),
        )

    @functools.cached_property
    def chunk_starts(self) -> tuple[int, ...]:
        """Each unit's first position in a rank's owned elements (its chunks, in unit order)."""
        sizes = [(b - a) // self.dp for a, b in self.units]
        return tuple(itertools.accumulate(sizes, initial=0))[:-1]

    def chunk(self, unit: int, rank: int) -> tuple[int, int]:
        """The flat range [lo, hi) of the unit that rank owns."""
        a, b = self.units[unit]
        size = (b - a) // self.dp
        return a + rank * size, a + (rank + 1) * size

    def owned_pieces(self, start: int, n: int, rank: int) -> list[tuple[int, int, int]]:
        """[(flat lo, flat hi, owned position of lo)]: the parts of the flat range [start, start +
        n) that rank owns."""
        out = []
        for u, first in enumerate(self.chunk_starts):
            lo, hi = self.chunk(u, rank)
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append((a, b, first + a - lo))
        return out

    def flatten(self, values: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        leaves = tree.tree_leaves(values)
        flat = torch.zeros(self.padded, dtype=dtype, device=leaves[0].device if leaves else None)
        for start, x in zip(self.starts, leaves):
            flat[start : start + x.numel()] = x.reshape(-1).to(dtype)
        return flat

    def unflatten(self, flat: torch.Tensor, like: Any) -> Any:
        leaves = [
            p.view(x.shape).to(x.dtype) for p, x in zip(self._pieces(flat), tree.tree_leaves(like))
        ]
        return tree.tree_unflatten(leaves, self.spec)

    def views(self, flat: torch.Tensor) -> Any:
        """The tree whose leaves are views of flat (no copy): writing either changes both."""
        pieces = self._pieces(flat)
        return tree.tree_unflatten([p.view(s) for p, s in zip(pieces, self.shapes)], self.spec)

    def _pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a : a + s.numel()] for a, s in zip(self.starts, self.shapes)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """rank's owned elements of a whole flat buffer (a view with one unit, else a copy)."""
        chunks = [flat[slice(*self.chunk(u, rank))] for u in range(len(self.units))]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def unshard(self, gathered: torch.Tensor) -> torch.Tensor:
        """The whole flat buffer from every rank's owned elements concatenated in rank order (an
        all-gather of the owned elements)."""
        by_rank = gathered.view(self.dp, -1)
        flat = gathered.new_empty(self.padded)
        for (a, b), first in zip(self.units, self.chunk_starts):
            size = (b - a) // self.dp
            flat[a:b].view(self.dp, size).copy_(by_rank[:, first : first + size])
        return flat

    def by_rank(self, flat: torch.Tensor) -> torch.Tensor:
        """unshard's inverse: the owned elements of every rank, concatenated in rank order (what a
        reduce-scatter hands out)."""
        out = flat.new_empty(self.padded)
        by_rank = out.view(self.dp, -1)
        for (a, b), first in zip(self.units, self.chunk_starts):
            size = (b - a) // self.dp
            by_rank[:, first : first + size].copy_(flat[a:b].view(self.dp, size))
        return out


def alone_in_unit(
    paths: Any, index: dict[str, int], units: list[list[int]] | None, who: str
) -> None:
    """Refuse replicated leaves (tied copies, summed chunk by chunk) that are not parameters or
    share a unit (units: each unit's leaves; None: not sliced, any leaf may be replicated)."""
    unknown = set(paths) - set(index)
    if unknown:
        raise ValueError(f"{who}: replicated paths {sorted(unknown)} are not parameters")
    for path in paths if units is not None else ():
        shared = next(u for u in units if index[path] in u)
        if len(shared) > 1:
            raise ValueError(f"{who}: replicated leaf {path} shares its unit with other leaves")


def owned_view(buffer: torch.Tensor, layout: FlatBuffer, leaf: int, rank: int) -> torch.Tensor:
    """rank's owned elements of leaf (a view of buffer, laid out whole or as the owned elements)."""
    start, n = layout.starts[leaf], layout.shapes[leaf].numel()
    pieces = layout.owned_pieces(start, n, rank)
    if not pieces:
        return buffer[:0]
    (a, b, at), *_ = pieces
    first = at if buffer.numel() == layout.padded // layout.dp else a
    return buffer[first : first + b - a]


class OwnedView:
    """This rank's owned elements of a buffer laid out whole (zero.FlatBuffer's, more than one
    unit), by owned position: [a:b] inside one chunk is a view of the buffer; chunks, each
    chunk's view."""

    def __init__(self, buffer: torch.Tensor, layout: FlatBuffer, rank: int):
        self.buffer = buffer
        self.starts = layout.chunk_starts
        self.ranges = [layout.chunk(u, rank) for u in range(len(layout.units))]
        self.chunks = [buffer[lo:hi] for lo, hi in self.ranges]

    def __getitem__(self, at: slice) -> torch.Tensor:
        a, b = at.start, at.stop
        for first, (lo, hi) in zip(self.starts, self.ranges):
            if first <= a and b <= first + hi - lo:
                return self.buffer[lo + a - first : lo + b - first]
        raise IndexError(f"OwnedView: [{a}, {b}) is not inside one chunk")
