"""Sharded weights (Megatron-FSDP's optim_grads_params): each rank keeps a slice; a unit is gathered
to be used.

    # owned: this rank's slice, compute dtype
    weights = ShardedParams(params, owned, dp_group, unit_of=unit)
    # {stage: tree} of views of per-unit buffers, empty until gathered
    weights.params
    # gathered on entry (the prefetched one waited for), freed on exit
    with weights.use(stage, ("layers.3",)):
        out = layer(weights.params[stage]["layers"][3], x)

The layout is zero.FlatBuffer's, and this rank owns the slice [rank * padded / dp, (rank + 1) *
padded / dp) as with ZeRO-1. A unit (a layer, the embedding, the head: unit_of(path)) covers a
contiguous range of the layout and has a buffer of its own, allocated once; its storage is resized
to nothing when the unit is not in use, so a rank holds at most the units in use and the one being
prefetched. Gathering a unit broadcasts each owner's piece of it into the buffer from the owner (a
unit usually lies inside one or two owners' slices), as every data-parallel rank does in the same
order. Autograd keeps the views a forward saved: their storage comes back, with the same values,
when backward gathers the unit again (the buffer's version counter is left alone, as torch's FSDP
does). use() also starts gathering the unit that came after this one last time (the order of the
previous iteration's uses, forward then backward), so its broadcast overlaps this unit's compute.

keep_after_forward(unit) (torch FSDP2's reshard_after_forward=False for the units it is true of): a
unit its forward used with autograd recording stays gathered until the matching backward has used
it, so backward does not gather it again; a rank then holds those units from their first forward to
their last backward.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, Iterator

import torch

from fmeg import tree
from fmeg.parallel.zero import FlatBuffer


class ShardedParams:
    def __init__(
        self,
        params: dict[int, Any],
        owned: torch.Tensor,
        group: Any,
        *,
        dp: int,
        rank: int,
        unit_of: Callable[[str], str],
        prefetch: bool = True,
        keep_after_forward: Callable[[str], bool] = lambda unit: False,
    ):
        """params: this rank's {stage: tree} (shapes only are read); owned: this rank's slice (the
        rank-th of dp) of the flat compute weights, which the optimizer writes; group: the dp ranks
        (None: no gathering from others); unit_of(path): a leaf's unit; keep_after_forward(unit):
        whether the unit stays gathered from a forward to its backward."""
        self.group, self.owned, self.prefetch, self.dp, self.rank = group, owned, prefetch, dp, rank
        self.keep_after_forward = keep_after_forward
        layout = FlatBuffer.of(params, self.dp)
        self.size = layout.padded // self.dp
        if owned.shape != (self.size,):
            raise ValueError(
                f"ShardedParams: owned slice of {tuple(owned.shape)}, need ({self.size},)"
            )
        paths = [path for path, _ in tree.items(params)]
        offsets = list(itertools.accumulate([s.numel() for s in layout.shapes], initial=0))
        self.units: dict[str, tuple[int, int]] = {}
        for path, a, b in zip(paths, offsets, offsets[1:]):
            unit = unit_of(path)
            start = self.units.get(unit, (a, b))[0]
            if unit in self.units and self.units[unit][1] != a:
                raise ValueError(
                    f"ShardedParams: unit {unit} is not contiguous in the layout (at {path})"
                )
            self.units[unit] = (start, b)
        self.buffers = {
            u: torch.empty(b - a, dtype=owned.dtype, device=owned.device)
            for u, (a, b) in self.units.items()
        }
        views = []
        for path, a, shape in zip(paths, offsets, layout.shapes):
            unit = unit_of(path)
            start = a - self.units[unit][0]
            views.append(self.buffers[unit][start : start + shape.numel()].view(shape))
        self.params = tree.tree_unflatten(views, layout.spec)
        for buffer in self.buffers.values():
            buffer.untyped_storage().resize_(0)
        self._users = {u: 0 for u in self.units}
        # forwards whose backward has not come yet (keep_after_forward)
        self._kept = {u: 0 for u in self.units}
        # unit -> pending handles (gathered, not yet waited for)
        self._gathering: dict[str, list] = {}
        # this iteration's uses (unit, backward?), in order
        self._order: list[tuple[str, bool]] = []
        # the unit used after each use, last iteration
        self._next: dict[tuple[str, bool], str] = {}

    @functools.cache  # noqa: B019 - one entry per segment, for the object's life
    def units_of(self, stage: int, keys: tuple[str, ...] | None) -> list[str]:
        """The units holding a segment's leaves (keys: paths inside the stage; None: the whole
        stage)."""
        prefixes = [f"{stage}."] if keys is None else [f"{stage}.{key}" for key in keys]
        return [
            u
            for u in self.units
            if any(
                u == p or u.startswith(p if p.endswith(".") else p + ".") or p.startswith(u + ".")
                for p in prefixes
            )
        ]

    @contextlib.contextmanager
    def use(
        self, stage: int, keys: tuple[str, ...] | None, backward: bool = False
    ) -> Iterator[None]:
        """A segment's units gathered while inside (backward: for its backward pass, which orders
        prefetches)."""
        units = self.units_of(stage, keys)
        for unit in units:
            self._acquire(unit, backward)
        if self.prefetch and units:
            following = self._next.get((units[-1], backward))
            if (
                following is not None
                and not self._users[following]
                and following not in self._gathering
            ):
                self._start(following)
        # a forward that a backward will follow
        keep = not backward and torch.is_grad_enabled()
        try:
            yield
        finally:
            for unit in units:
                if keep and self.keep_after_forward(unit):
                    self._kept[unit] += 1
                    continue
                self._release(unit)
                if backward and self._kept[unit]:
                    self._kept[unit] -= 1
                    self._release(unit)

    @contextlib.contextmanager
    def everything(self) -> Iterator[None]:
        """Every unit gathered (a norm of the weights, a checkpoint of whole weights)."""
        for unit in self.units:
            self._acquire(unit)
        try:
            yield
        finally:
            for unit in self.units:
                self._release(unit)

    def end_iteration(self) -> None:
        """Remember this iteration's order of use for the next one's prefetches; drop a prefetch
        never used and the units kept from a forward no backward came for."""
        for unit, kept in self._kept.items():
            for _ in range(kept):
                self._release(unit)
            self._kept[unit] = 0
        if self._order:
            self._next = {u: v[0] for u, v in zip(self._order, self._order[1:]) if u[0] != v[0]}
        self._order = []
        for unit in list(self._gathering):
            self._wait(unit)
            if not self._users[unit]:
                self.buffers[unit].untyped_storage().resize_(0)

    def _acquire(self, unit: str, backward: bool = False) -> None:
        if self._order[-1:] != [(unit, backward)]:
            self._order.append((unit, backward))
        if not self._users[unit]:
            if unit not in self._gathering:
                self._start(unit)
            self._wait(unit)
        self._users[unit] += 1

    def _release(self, unit: str) -> None:
        self._users[unit] -= 1
        if not self._users[unit] and unit not in self._gathering:
            self.buffers[unit].untyped_storage().resize_(0)

    def _start(self, unit: str) -> None:
        """Give the unit's buffer storage and start broadcasting each owner's piece into it."""
        a, b = self.units[unit]
        buffer = self.buffers[unit]
        buffer.untyped_storage().resize_((b - a) * buffer.element_size())
        handles = []
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
            for owner in range(a // self.size, (b - 1) // self.size + 1):
                lo, hi = max(a, owner * self.size), min(b, (owner + 1) * self.size)
                piece = buffer[lo - a : hi - a]
                if owner == self.rank:
                    piece.copy_(self.owned[lo - owner * self.size : hi - owner * self.size])
                elif self.group is None:
                    raise RuntimeError(
                        f"ShardedParams: unit {unit} needs rank {owner}'s slice and there is no "
                        "group"
                    )
                if self.group is not None:
                    handles.append(self.group.broadcast_async(piece, owner))
        self._gathering[unit] = handles

    def _wait(self, unit: str) -> None:
        for handle in self._gathering.pop(unit, ()):
            handle.wait()
