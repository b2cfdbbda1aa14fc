"""Sharded gradients (Megatron-FSDP's optim_grads): each microbatch's gradients reduce-scattered
into every rank's chunks.

    # accumulator: this rank's owned elements
    sync = ShardedGradSync(params, dp_group, accumulator, unit_of=unit)
    # every microbatch: each unit, once its leaves are in, reduce-scattered
    execute(..., grads_into=sync)
    # waits; accumulator holds its chunks of the dp mean
    sync.finish()
    # the tied copies' owned elements (sync.leaf), summed in place

The layout is zero.FlatBuffer's with these units (a layer, the embedding, the head), each padded to
a multiple of dp, and this rank owns the rank-th 1/dp of every unit (its chunk), as with
ShardedParams; no rank keeps the whole gradient. A microbatch's gradients go into a staging tensor
per unit, allocated when the unit's first leaf arrives; when its last leaf has arrived the unit is
reduce-scattered (one collective per unit and microbatch), each rank adds its chunk of the sum into
its accumulator, and the staging is freed. At most `in_flight` reductions are outstanding, which
bounds the staging memory. Leaves named `replicated` (the tied embedding copies, whose gradients
are summed over pipeline stages after the mean) are units of their own, of one size: their chunks
hold the same elements of each copy, and the copies are summed chunk by chunk (leaf()).

Arithmetic: the accumulator holds sum over microbatches of (sum over ranks), where ZeRO-1 reduces
the sum over microbatches once; with one microbatch per rank the two are the same numbers.

exact=True (--deterministic-mode): every microbatch's gradients go into an ExactAccumulator of the
whole flat gradient instead (no staging, no overlap), and finish() reduce-scatters its int64 bins a
unit at a time (fmeg.parallel.exact): the owned chunks are then the same bits as ZeRO-1's, for
any data-parallel size and any number of microbatches a rank; the divisor should be 1 (the mean
taken by the backward's seed over the global batch). It holds 24 bytes an element of the whole
gradient, as ZeRO-1's exact sums do.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fmeg import tree
from fmeg.parallel.exact import ExactAccumulator
from fmeg.parallel.zero import FlatBuffer, alone_in_unit, owned_view


class ShardedGradSync:
    def __init__(
        self,
        params: dict[int, Any],
        group: Any,
        accumulator: torch.Tensor,
        *,
        unit_of: Callable[[str], str],
        replicated: frozenset[str] = frozenset(),
        divisor: int | None = None,
        in_flight: int = 2,
        replicas: Any = None,
        exact: bool = False,
    ):
        """params: this rank's {stage: tree} (shapes only are read); accumulator: this rank's owned
        elements of the flat gradient (padded / dp, any float dtype); unit_of(path): the unit a
        leaf belongs to; divisor: what the group's sum is divided by (default its size); replicas:
        hybrid sharding's group of the ranks holding the same chunks, over which the owned
        elements are summed at finish() (None: none); exact: the sums exact (above)."""
        self.replicas = replicas
        self.group, self.dp = group, 1 if group is None else group.size
        self.rank = 0 if group is None else group.rank
        self.divisor = self.dp if divisor is None else divisor
        self.layout = layout = FlatBuffer.of(params, self.dp, unit_of)
        self.size = layout.padded // self.dp
        if accumulator.shape != (self.size,):
            raise ValueError(
                f"ShardedGradSync: accumulator of {tuple(accumulator.shape)}, need ({self.size},)"
            )
        self.accumulator, self.in_flight = accumulator, in_flight
        self.paths = [path for path, _ in tree.items(params)]
        self.shapes, self.starts = list(layout.shapes), list(layout.starts)
        self.index = {path: i for i, path in enumerate(self.paths)}
        names = list(dict.fromkeys(unit_of(path) for path in self.paths))
        unit_index = {name: u for u, name in enumerate(names)}
        # each leaf's unit; each unit's leaves reduced through its staging
        self.unit_of_leaf = [unit_index[unit_of(path)] for path in self.paths]
        self.reduced = [
            [i for i, u in enumerate(self.unit_of_leaf) if u == k] for k in range(len(names))
        ]
        alone_in_unit(replicated, self.index, self.reduced, "ShardedGradSync")
        self._index_cache: dict[tuple, list[int]] = {}
        self.exact = ExactAccumulator(layout.padded, accumulator.device) if exact else None
        self.reset()

    def reset(self) -> "ShardedGradSync":
        self._waiting = [len(leaves) for leaves in self.reduced]
        self._staging: list[torch.Tensor | None] = [None] * len(self.reduced)
        # reductions added into the accumulator this iteration
        self._rounds = [0] * len(self.reduced)
        self._touched = [False] * len(self.paths)
        self._pending: list[tuple[Any, int, torch.Tensor]] = []
        if self.exact is not None:
            self.exact.reset()
        return self

    def add(self, stage: int, grads: dict[str, torch.Tensor], final: bool = False) -> None:
        """Add one microbatch's gradients of some leaves of `stage` (each leaf once per
        microbatch)."""
        key = (stage, tuple(grads))
        indices = self._index_cache.get(key)
        if indices is None:
            indices = self._index_cache[key] = [self.index[f"{stage}.{p}"] for p in grads]
        for i, grad in zip(indices, grads.values()):
            self._touched[i] = True
            if self.exact is not None:
                self.exact.add_(self.starts[i], grad)
                continue
            flat = grad.reshape(-1)
            k = self.unit_of_leaf[i]
            a, b = self.layout.units[k]
            if self._staging[k] is None:
                self._staging[k] = torch.zeros(
                    b - a, dtype=self.accumulator.dtype, device=flat.device
                )
            at = self.starts[i] - a
            self._staging[k][at : at + flat.numel()].copy_(flat)
            self._waiting[k] -= 1
            if self._waiting[k] == 0:
                self._start(k)

    def ready(self, stage: int, grads: dict[str, torch.Tensor]) -> None:
        self.add(stage, grads, final=True)

    def _start(self, k: int) -> None:
        staging, self._staging[k] = self._staging[k], None
        self._waiting[k] = len(self.reduced[k])
        if self.group is None:
            handle, mine = None, staging
        else:
            mine = staging.new_empty(staging.numel() // self.dp)
            handle = self.group.reduce_scatter_async(mine, staging)
        self._pending.append((handle, k, mine))
        while len(self._pending) > self.in_flight:
            self._complete()

    def _complete(self) -> None:
        handle, k, mine = self._pending.pop(0)
        if handle is not None:
            handle.wait()
        first = self.layout.chunk_starts[k]
        target = self.accumulator[first : first + mine.numel()]
        if self._rounds[k]:
            target.add_(mine)
        else:
            target.copy_(mine)
        self._rounds[k] += 1

    def finish(self) -> "ShardedGradSync":
        missing = [p for p, touched in zip(self.paths, self._touched) if not touched]
        if missing:
            raise RuntimeError(
                "ShardedGradSync: no gradient for "
                f"{missing[:3]}{' ...' if len(missing) > 3 else ''}"
            )
        while self._pending:
            self._complete()
        if self.exact is not None:
            return self._finish_exact()
        if self.replicas is not None:
            self.accumulator.copy_(self.replicas.all_reduce(self.accumulator.clone()))
        if self.divisor != 1:
            self.accumulator.div_(self.divisor)
        return self

    def _finish_exact(self) -> "ShardedGradSync":
        """The owned chunks of the exact sum over the group (and the replicas), rounded once."""
        chunks = self.exact.scatter_over(self.group, self.layout.units)
        chunks.sum_over(self.replicas)
        self.accumulator.copy_(chunks.value(self.accumulator.dtype))
        if self.divisor != 1:
            self.accumulator.div_(self.divisor)
        return self

    def leaf(self, path: str) -> torch.Tensor:
        """This rank's owned elements of a replicated leaf's mean gradient (after finish), a view
        of the accumulator: the same elements of every copy."""
        return owned_view(self.accumulator, self.layout, self.index[path], self.rank)

    def settle(self) -> "ShardedGradSync":
        """Nothing to do: the tied copies are summed in the accumulator."""
        return self

    def owned(self) -> torch.Tensor:
        return self.accumulator
