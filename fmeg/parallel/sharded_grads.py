"""Sharded gradients (Megatron-FSDP's optim_grads): each microbatch's gradients reduced into the
owners' slices.

    # accumulator: this rank's slice
    sync = ShardedGradSync(params, dp_group, accumulator, unit_of=unit)
    # every microbatch: each bucket, once its leaves are in, reduced to its owner
    execute(..., grads_into=sync)
    # waits; accumulator holds the slice of the dp mean, replicated leaves whole
    sync.finish()
    # after the tied copies are summed (sync.leaf): their owned parts copied in
    sync.settle()

The layout is zero.FlatBuffer's (leaves in tree order, padded to a multiple of dp) and this rank
owns the slice [rank * padded / dp, (rank + 1) * padded / dp), as with ZeRO-1; but no rank keeps the
whole gradient. A microbatch's gradients go into a staging tensor per bucket, allocated when the
bucket's first leaf arrives; when its last leaf has arrived the bucket is reduced to the rank owning
it (buckets lie inside one owner's slice, one pipeline stage and one unit: a layer), the owner adds
it into its accumulator, and the staging is freed. At most `in_flight` reductions are outstanding,
which bounds the staging memory. Leaves named `replicated` (the tied embedding copies, whose
gradients are summed over pipeline stages after the mean) are kept whole in a buffer of their own
over the iteration and all-reduced at finish().

Arithmetic: the accumulator holds sum over microbatches of (sum over ranks), where ZeRO-1 reduces
the sum over microbatches once; with one microbatch per rank the two are the same numbers.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from fmeg import tree
from fmeg.parallel.data_parallel import _buckets, default_bucket_numel
from fmeg.parallel.zero import FlatBuffer


class ShardedGradSync:
    def __init__(
        self,
        params: dict[int, Any],
        group: Any,
        accumulator: torch.Tensor,
        *,
        unit_of: Callable[[str], str],
        replicated: frozenset[str] = frozenset(),
        bucket_numel: int | None = None,
        divisor: int | None = None,
        in_flight: int = 2,
        replicas: Any = None,
    ):
        """params: this rank's {stage: tree} (shapes only are read); accumulator: this rank's slice
        of the flat gradient (padded / dp elements, any float dtype); unit_of(path): the unit a leaf
        belongs to (buckets never span two); divisor: what the group's sum is divided by (default
        its size); replicas: hybrid sharding's group of the ranks holding the same slices, over
        which the slice and the replicated leaves are summed at finish() (None: none)."""
        self.replicas = replicas
        self.group, self.dp = group, 1 if group is None else group.size
        self.rank = 0 if group is None else group.rank
        self.divisor = self.dp if divisor is None else divisor
        layout = FlatBuffer.of(params, self.dp)
        self.size = layout.padded // self.dp
        if accumulator.shape != (self.size,):
            raise ValueError(
                f"ShardedGradSync: accumulator of {tuple(accumulator.shape)}, need ({self.size},)"
            )
        self.accumulator, self.in_flight = accumulator, in_flight
        leaves = list(tree.items(params))
        self.paths = [path for path, _ in leaves]
        self.shapes = list(layout.shapes)
        sizes = [shape.numel() for shape in self.shapes]
        self.offsets = list(itertools.accumulate(sizes, initial=0))
        self.index = {path: i for i, path in enumerate(self.paths)}
        unknown = set(replicated) - set(self.index)
        if unknown:
            raise ValueError(
                f"ShardedGradSync: replicated paths {sorted(unknown)} are not parameters"
            )
        self.replicated = {self.index[p] for p in replicated}
        units = [unit_of(path) for path in self.paths]
        unit_cuts = {self.offsets[i] for i in range(1, len(units)) if units[i] != units[i - 1]}
        buckets = _buckets(
            sizes,
            layout.padded,
            self.dp,
            self.replicated,
            bucket_numel or default_bucket_numel(self.dp),
            extra_cuts=unit_cuts,
        )
        self.buckets = [
            (a, b, [i for i in leaves_of if i not in self.replicated], a // self.size)
            for a, b, leaves_of, _ in buckets
            if not (leaves_of and all(i in self.replicated for i in leaves_of))
        ]
        self._buckets_of: list[list[int]] = [[] for _ in self.paths]
        for k, (_, _, leaves_of, _) in enumerate(self.buckets):
            for i in leaves_of:
                self._buckets_of[i].append(k)
        device = accumulator.device
        whole_dtype = torch.promote_types(accumulator.dtype, torch.float32)
        self.whole = {
            i: torch.zeros(self.shapes[i], dtype=whole_dtype, device=device)
            for i in self.replicated
        }
        self._index_cache: dict[tuple, list[int]] = {}
        self.reset()

    def reset(self) -> "ShardedGradSync":
        self._waiting = [len(leaves_of) for _, _, leaves_of, _ in self.buckets]
        self._staging: list[torch.Tensor | None] = [None] * len(self.buckets)
        # reductions added into the accumulator this iteration
        self._rounds = [0] * len(self.buckets)
        self._touched = [False] * len(self.paths)
        self._pending: list[tuple[Any, int, torch.Tensor]] = []
        for whole in self.whole.values():
            whole.zero_()
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
            flat = grad.reshape(-1)
            if i in self.replicated:
                self.whole[i].view(-1).add_(flat)
                continue
            for k in self._buckets_of[i]:
                a, b, _, _ = self.buckets[k]
                lo, hi = max(a, self.offsets[i]), min(b, self.offsets[i + 1])
                if self._staging[k] is None:
                    self._staging[k] = torch.zeros(
                        b - a, dtype=self.accumulator.dtype, device=flat.device
                    )
                self._staging[k][lo - a : hi - a].copy_(
                    flat[lo - self.offsets[i] : hi - self.offsets[i]]
                )
                self._waiting[k] -= 1
                if self._waiting[k] == 0:
                    self._start(k)

    def ready(self, stage: int, grads: dict[str, torch.Tensor]) -> None:
        self.add(stage, grads, final=True)

    def _start(self, k: int) -> None:
        a, b, leaves_of, owner = self.buckets[k]
        staging, self._staging[k] = self._staging[k], None
        self._waiting[k] = len(leaves_of)
        handle = None if self.group is None else self.group.reduce_async(staging, owner)
        self._pending.append((handle, k, staging))
        while len(self._pending) > self.in_flight:
            self._complete()

    def _complete(self) -> None:
        handle, k, staging = self._pending.pop(0)
        if handle is not None:
            handle.wait()
        a, b, _, owner = self.buckets[k]
        if owner == self.rank or self.group is None:
            target = self.accumulator[a - self.rank * self.size : b - self.rank * self.size]
            if self._rounds[k]:
                target.add_(staging)
            else:
                target.copy_(staging)
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
        lo = self.rank * self.size
        for k, (a, b, leaves_of, owner) in enumerate(self.buckets):
            # padding
            if owner == self.rank and not self._rounds[k]:
                self.accumulator[a - lo : b - lo].zero_()
        for i, whole in self.whole.items():
            for group in (self.group, self.replicas):
                if group is not None:
                    # a clone: thread peers may still read it
                    whole.copy_(group.all_reduce(whole.clone()))
            whole.div_(self.divisor)
        if self.replicas is not None:
            self.accumulator.copy_(self.replicas.all_reduce(self.accumulator.clone()))
        if self.divisor != 1:
            self.accumulator.div_(self.divisor)
        return self

    def leaf(self, path: str) -> torch.Tensor:
        """The whole mean gradient of a replicated leaf (after finish)."""
        return self.whole[self.index[path]]

    def settle(self) -> "ShardedGradSync":
        """Copy the replicated leaves' owned parts into the accumulator (after the tied copies are
        summed)."""
        lo, hi = self.rank * self.size, (self.rank + 1) * self.size
        for i, whole in self.whole.items():
            a, b = max(self.offsets[i], lo), min(self.offsets[i + 1], hi)
            if a < b:
                self.accumulator[a - lo : b - lo].copy_(
                    whole.view(-1)[a - self.offsets[i] : b - self.offsets[i]]
                )
        return self

    def owned(self) -> torch.Tensor:
        return self.accumulator
