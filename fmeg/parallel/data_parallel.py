"""Data-parallel gradient reduction in buckets, started while the backward pass is still running.

    sync = GradSync(params, dp_group, owner_slices=zero)   # params: this rank's {stage: tree}
    # each microbatch's gradients added into the buffer; final ones start buckets
    execute(..., grads_into=sync)
    sync.finish()                                          # waits; the buffer now holds the dp mean
    # replicated optimizer: the whole mean as a pytree of views into the buffer
    grads = sync.tree()
    g = sync.owned()        # ZeRO-1: this rank's slice, laid out as zero.FlatBuffer's

Gradients accumulate in one flat buffer (at least fp32 unless a buffer of another dtype is given, as
--grad-reduce-in-bf16 gives a bf16 one; the first contribution of an iteration is copied, the others
added) laid out like zero.FlatBuffer: leaves in tree order, padded to a multiple of dp. The buffer
is cut into buckets, and a bucket's collective starts as soon as its last leaf has arrived, so
communication overlaps with the rest of the backward pass. Without ZeRO a bucket holds about
bucket_numel elements, walking leaves in reverse (the order backward produces them, as Megatron
does), and is all-reduced. With ZeRO a bucket is a unit of the layout (unit_of: a layer; each
padded to a multiple of dp, each rank owning the rank-th 1/dp of it) and is reduce-scattered, one
collective per unit; `replicated` leaves (the tied embedding copies, whose gradients are summed
across pipeline stages afterwards) are then units of their own, whose owned elements leaf() gives
(the same elements of each copy). Which
bucket starts when depends only on the schedule, so every data-parallel rank issues the same
collectives in the same order. Without overlap (overlap=False) buckets start at finish(), in tree
order: the same numbers.

exact=True (--deterministic-mode): the contributions go into an ExactAccumulator instead, which
finish() sums over the group (and the replicas) and writes into the buffer: the same bits for any
data-parallel size and any number of microbatches a rank. Its collectives wait for finish() (no
overlap), and the divisor should be 1, the mean taken by the backward's seed over the global
batch (a division would round differently at each dp).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Callable

import torch

from fmeg import tree
from fmeg.parallel.exact import ExactAccumulator
from fmeg.parallel.zero import FlatBuffer, alone_in_unit, owned_view


def default_bucket_numel(dp: int) -> int:
    """Megatron's default --ddp-bucket-size: max(40M, 1M * dp) elements."""
    return max(40_000_000, 1_000_000 * dp)


class GradSync:
    """An iteration's data-parallel gradient mean (group None: dp = 1); reset() readies it for the
    next iteration without rebuilding the layout and the buckets."""

    def __init__(
        self,
        params: dict[int, Any],
        group: Any,
        *,
        owner_slices: bool = False,
        replicated: frozenset[str] = frozenset(),
        bucket_numel: int | None = None,
        buffer: torch.Tensor | None = None,
        overlap: bool = True,
        divisor: int | None = None,
        replicas: Any = None,
        unit_of: Callable[[str], str] | None = None,
        exact: bool = False,
    ):
        """unit_of: the units of ZeRO's layout (zero.FlatBuffer; None: one); buffer: a persistent
        flat gradient buffer to fill (zero in its padding), else a fresh
        one; overlap: start each bucket once its leaves are final, else all of them at finish();
        divisor: what the group's sum is divided by (default its size: the mean; context-parallel
        ranks, whose gradients are their tokens' shares, divide by the data-parallel size alone);
        replicas: hybrid sharding's group of the ranks holding the same slices (None: none): what
        this rank holds of the sum over group (its owned slice, the replicated leaves) is summed
        over it at finish(), as Megatron sums over its distributed-optimizer instances; exact: the
        sums in an ExactAccumulator (above)."""
        self.group, self.dp = group, 1 if group is None else group.size
        self.replicas = replicas
        self.divisor = self.dp if divisor is None else divisor
        self.rank = 0 if group is None else group.rank
        # the flat layout ZeRO-1 slices
        self.layout = FlatBuffer.of(params, self.dp, unit_of if owner_slices else None)
        self.owner_slices, self.spec, self.shapes = (
            owner_slices,
            self.layout.spec,
            self.layout.shapes,
        )
        self.padded = self.layout.padded
        leaves = list(tree.items(params))
        self.paths = [path for path, _ in leaves]
        sizes = [shape.numel() for shape in self.shapes]
        self.offsets = list(self.layout.starts)
        self.index = {path: i for i, path in enumerate(self.paths)}
        if buffer is not None and (
            buffer.shape != (self.padded,) or not buffer.is_floating_point()
        ):
            raise ValueError(
                f"GradSync: buffer of {tuple(buffer.shape)} {buffer.dtype}, need ({self.padded},) "
                "floats"
            )
        dtype = torch.promote_types(leaves[0][1].dtype if leaves else torch.float32, torch.float32)
        self.buffer = (
            buffer
            if buffer is not None
            else torch.zeros(
                self.padded, dtype=dtype, device=leaves[0][1].device if leaves else "cpu"
            )
        )
        whole = {self.index[p] for p in replicated}
        self.buckets = (
            _unit_buckets(self.layout)
            if owner_slices
            else _buckets(sizes, self.padded, whole, bucket_numel or default_bucket_numel(self.dp))
        )
        self.replicated = whole
        units = [leaves for _, _, leaves, _ in self.buckets] if owner_slices else None
        alone_in_unit(replicated, self.index, units, "GradSync")
        self._buckets_of: list[list[int]] = [[] for _ in leaves]
        for b, (_, _, leaves_of, _) in enumerate(self.buckets):
            for i in leaves_of:
                self._buckets_of[i].append(b)
        self._views = [
            self.buffer[start : start + shape.numel()].view(shape)
            for start, shape in zip(self.offsets, self.shapes)
        ]
        self.exact = ExactAccumulator(self.padded, device=self.buffer.device) if exact else None
        self.overlap = overlap and not exact
        self._index_cache: dict[tuple, list[int]] = {}
        self.reset()

    def reset(self) -> "GradSync":
        """Ready for an iteration: no gradient arrived yet (the buffer's old values are overwritten
        by each leaf's first contribution)."""
        if self.exact is not None:
            self.exact.reset()
        self._waiting = [len(leaves_of) for _, _, leaves_of, _ in self.buckets]
        self._arrived = [False] * len(self.paths)
        # received a contribution this iteration
        self._touched = [False] * len(self.paths)
        # (handle, this rank's chunk of the sum, where it goes)
        self._handles: list[tuple[Any, torch.Tensor | None, torch.Tensor | None]] = []
        # leaves still to come when each bucket started
        self.started_with_pending: list[int] = []
        for b, waiting in enumerate(self._waiting):
            # padding only
            if waiting == 0:
                self._start(b)
        return self

    def add(self, stage: int, grads: dict[str, torch.Tensor], final: bool = False) -> None:
        """Add gradients of some leaves of `stage` ({path inside the stage: gradient}) into the
        buffer; final: nothing more comes for them this iteration (their buckets may start). The
        leaves' first contributions are copied and later ones added, each group as one multi-tensor
        op."""
        indices = self._indices(stage, tuple(grads))
        late = [i for i in indices if self._arrived[i]]
        if late:
            raise RuntimeError(
                f"GradSync: gradient of {self.paths[late[0]]} given after its final one"
            )
        if self.exact is not None:
            for i, grad in zip(indices, grads.values()):
                self.exact.add_(self.offsets[i], grad)
                self._touched[i] = True
            return
        copy: tuple[list, list] = ([], [])
        add: tuple[list, list] = ([], [])
        for i, grad in zip(indices, grads.values()):
            target = add if self._touched[i] else copy
            target[0].append(self._views[i])
            target[1].append(grad.reshape(self.shapes[i]))
            self._touched[i] = True
        if copy[0]:
            torch._foreach_copy_(*copy)
        if add[0]:
            torch._foreach_add_(*add)
        if final and self.overlap:
            for i in indices:
                self._arrive(i)

    def _indices(self, stage: int, paths: tuple[str, ...]) -> list[int]:
        """The buffer leaves of these stage paths (cached: each segment hands over the same paths
        every time)."""
        key = (stage, paths)
        found = self._index_cache.get(key)
        if found is None:
            found = self._index_cache[key] = [self.index[f"{stage}.{path}"] for path in paths]
        return found

    def ready(self, stage: int, grads: dict[str, torch.Tensor]) -> None:
        """Take the final gradients of some leaves of `stage`."""
        self.add(stage, grads, final=True)

    def _arrive(self, i: int) -> None:
        self._arrived[i] = True
        for b in self._buckets_of[i]:
            self._waiting[b] -= 1
            if self._waiting[b] == 0:
                self._start(b)

    def finish(self) -> "GradSync":
        missing = [p for p, touched in zip(self.paths, self._touched) if not touched]
        if missing:
            raise RuntimeError(
                f"GradSync: no gradient for {missing[:3]}{' ...' if len(missing) > 3 else ''}"
            )
        # without overlap: every bucket starts now
        for i, arrived in enumerate(self._arrived):
            if not arrived:
                self._arrive(i)
        if self.exact is not None:
            self.exact.sum_over((self.group, self.replicas))
            self.buffer.copy_(self.exact.value(self.buffer.dtype))
        for handle, mine, target in self._handles:
            handle.wait()
            if target is not None:
                target.copy_(mine)
        self._handles = []
        if self.replicas is not None and self.exact is None:
            for a, b in self._held_ranges():
                # a clone: thread peers may still read it
                self.buffer[a:b].copy_(self.replicas.all_reduce(self.buffer[a:b].clone()))
        if self.divisor != 1:
            self.buffer.div_(self.divisor)
        return self

    def _held_ranges(self) -> list[tuple[int, int]]:
        """The disjoint element ranges of the buffer this rank holds reduced: its owned slice and
        the replicated leaves (everything without owner slices)."""
        if not self.owner_slices:
            return [(0, self.padded)]
        ranges = [
            self.layout.chunk(u, self.rank) if scatter else (a, b)
            for u, (a, b, _, scatter) in enumerate(self.buckets)
        ]
        merged: list[tuple[int, int]] = []
        for a, b in sorted(r for r in ranges if r[1] > r[0]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    def settle(self) -> "GradSync":
        """Nothing to do: the buffer is whole (ShardedGradSync copies the tied leaves' owned parts
        here)."""
        return self

    def tree(self) -> dict[int, Any]:
        """{stage: gradient tree} as views into the buffer (valid where this rank holds the
        mean)."""
        return tree.tree_unflatten([self._view(i) for i in range(len(self.paths))], self.spec)

    def leaf(self, path: str) -> torch.Tensor:
        """A leaf's gradient: with owner slices, a replicated leaf's owned elements (flat)."""
        i = self.index[path]
        if self.owner_slices and i in self.replicated:
            return owned_view(self.buffer, self.layout, i, self.rank)
        return self._view(i)

    def owned(self) -> torch.Tensor:
        """This rank's owned elements of the flat buffer (ZeRO-1's gradient shard; a copy with
        more than one unit)."""
        return self.layout.shard(self.buffer, self.rank)

    def _view(self, i: int) -> torch.Tensor:
        return self._views[i]

    def _start(self, b: int) -> None:
        start, end, _, scatter = self.buckets[b]
        self.started_with_pending.append(self._arrived.count(False))
        if self.group is None or self.exact is not None:
            return
        piece = self.buffer[start:end]
        if not scatter:
            self._handles.append((self.group.all_reduce_async(piece), None, None))
            return
        # into a tensor of its own (NCCL may write its input's chunk in place; gloo may not)
        mine = piece.new_empty(piece.numel() // self.dp)
        target = self.buffer[slice(*self.layout.chunk(b, self.rank))]
        self._handles.append((self.group.reduce_scatter_async(mine, piece), mine, target))


def _unit_buckets(layout: FlatBuffer) -> list[tuple[int, int, list[int], bool]]:
    """[(start, end, leaves, True: reduce-scattered)]: one bucket per unit of the layout."""
    firsts = [a for a, _ in layout.units]
    leaves: list[list[int]] = [[] for _ in layout.units]
    for i, start in enumerate(layout.starts):
        leaves[max(bisect.bisect_right(firsts, start) - 1, 0)].append(i)
    return [(a, b, found, True) for (a, b), found in zip(layout.units, leaves)]


def _buckets(
    sizes: list[int], padded: int, replicated: set[int], bucket_numel: int
) -> list[tuple[int, int, list[int], bool]]:
    """[(start, end, leaves it touches, False: all-reduced)], in the order backward fills them:
    element ranges cut at leaf boundaries once they hold bucket_numel elements, always cut around
    replicated leaves."""
    offsets = list(itertools.accumulate(sizes, initial=0))
    hard = {0, padded}
    for i in replicated:
        hard |= {offsets[i], offsets[i + 1]}
    cuts = sorted(hard | set(offsets))

    # the leaf holding element `position`; None in the padding
    def leaf_at(position: int) -> int | None:
        i = bisect.bisect_right(offsets, position) - 1
        return i if i < len(sizes) and sizes[i] > 0 else None

    out: list[tuple[int, int, list[int], bool]] = []
    end, touched = None, set()
    for a, b in reversed([(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]):
        end = b if end is None else end
        leaf = leaf_at(a)
        touched |= {leaf} - {None}
        if a in hard or end - a >= bucket_numel:
            out.append((a, end, sorted(touched), False))
            end, touched = None, set()
    return out
