"""Sharded weights (Megatron-FSDP's optim_grads_params): each rank keeps a slice; a unit is gathered
to be used.

    # owned: this rank's slice, compute dtype
    weights = ShardedParams(params, owned, dp_group, unit_of=unit)
    # {stage: tree} of views of per-unit buffers, empty until gathered
    weights.params
    # gathered on entry (the prefetched one waited for), freed on exit
    with weights.use(stage, ("layers.3",)):
        out = layer(weights.params[stage]["layers"][3], x)

The layout is zero.FlatBuffer's with these units: each unit is padded to a multiple of dp and this
rank owns the rank-th 1/dp of it (its chunk), as Megatron-FSDP and FSDP2 shard. A unit (a layer,
the embedding, the head: unit_of(path)) has a buffer of its own, allocated once; its storage is
resized to nothing when the unit is not in use, so a rank holds at most the units in use and the
one being prefetched. Gathering a unit is one all-gather of every rank's chunk into its buffer, as
every data-parallel rank does in the same order. Autograd keeps the views a forward saved: their
storage comes back, with the same values, when backward gathers the unit again (the buffer's
version counter is left alone, as torch's FSDP does). use() also starts gathering the unit that
came after this one last time (the order of the previous iteration's uses, forward then
backward), so its all-gather overlaps this unit's compute.

keep_after_forward(unit) (torch FSDP2's reshard_after_forward=False for the units it is true of): a
unit its forward used with autograd recording stays gathered until the matching backward has used
it, so backward does not gather it again; a rank then holds those units from their first forward to
their last backward.
"""

from __future__ import annotations

import contextlib
import functools
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
        layout = FlatBuffer.of(params, self.dp, unit_of)
        self.size = layout.padded // self.dp
        if owned.shape != (self.size,):
            raise ValueError(
                f"ShardedParams: owned slice of {tuple(owned.shape)}, need ({self.size},)"
            )
        paths = [path for path, _ in tree.items(params)]
        names = list(dict.fromkeys(unit_of(path) for path in paths))
        # unit -> its flat range (padded); its chunk's first position in owned
        self.units: dict[str, tuple[int, int]] = dict(zip(names, layout.units))
        self.chunks = dict(zip(names, layout.chunk_starts))
        self.buffers = {
            u: torch.empty(b - a, dtype=owned.dtype, device=owned.device)
            for u, (a, b) in self.units.items()
        }
        views = []
        for path, start, shape in zip(paths, layout.starts, layout.shapes):
            unit = unit_of(path)
            first = start - self.units[unit][0]
            views.append(self.buffers[unit][first : first + shape.numel()].view(shape))
        self.params = tree.tree_unflatten(views, layout.spec)
        for buffer in self.buffers.values():
            buffer.untyped_storage().resize_(0)
        self._users = {u: 0 for u in self.units}
        # forwards whose backward has not come yet (keep_after_forward)
        self._kept = {u: 0 for u in self.units}
        # unit -> pending handles (gathered, not yet waited for)
        self._gathering: dict[str, list] = {}
        # each unit's version counter when its gathering started
        self._versions: dict[str, int] = {}
        # this iteration's uses (unit, backward?), in order
        self._order: list[tuple[str, bool]] = []
        # the unit used after each use, last iteration
        self._next: dict[tuple[str, bool], str] = {}
        # --fp8-param-gather's fmeg.fp8.param_gather.Fp8ParamGather over these units (the runner
        # sets it): use() gathers FP8 bytes while it holds scales; every unit's index in it
        self.fp8 = None
        self._index = {u: i for i, u in enumerate(self.units)}
        # unit -> the bytes an FP8 gather is filling
        self._packed: dict[str, torch.Tensor] = {}

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
        """Every unit gathered in the compute dtype (a norm of the weights, a checkpoint of whole
        weights): a prefetch in FP8 is dropped first."""
        for unit in list(self._gathering):
            self._wait(unit)
            if not self._users[unit]:
                self.buffers[unit].untyped_storage().resize_(0)
        for unit in self.units:
            self._acquire(unit, exact=True)
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

    def _acquire(self, unit: str, backward: bool = False, exact: bool = False) -> None:
        if not exact and self._order[-1:] != [(unit, backward)]:
            self._order.append((unit, backward))
        if not self._users[unit]:
            if unit not in self._gathering:
                self._start(unit, exact)
            self._wait(unit)
        self._users[unit] += 1

    def _release(self, unit: str) -> None:
        self._users[unit] -= 1
        if not self._users[unit] and unit not in self._gathering:
            self.buffers[unit].untyped_storage().resize_(0)

    def _start(self, unit: str, exact: bool = False) -> None:
        """Give the unit's buffer storage and start all-gathering every rank's chunk into it (in
        FP8 bytes where self.fp8 holds scales, unless exact)."""
        a, b = self.units[unit]
        buffer, size = self.buffers[unit], (b - a) // self.dp
        buffer.untyped_storage().resize_((b - a) * buffer.element_size())
        mine = self.owned[self.chunks[unit] :][:size]
        self._versions[unit] = buffer._version
        fp8 = self.fp8 if self.fp8 is not None and self.fp8.scale is not None else None
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
            if fp8 is not None and not exact and self.group is not None:
                index = self._index[unit]
                out = torch.empty(fp8.bytes_of(index), dtype=torch.uint8, device=buffer.device)
                self._packed[unit] = out
                self._gathering[unit] = [
                    self.group.all_gather_into_async(out, fp8.pack(index, mine))
                ]
            elif self.group is None:
                if self.dp > 1:
                    raise RuntimeError(
                        f"ShardedParams: unit {unit} needs the other ranks' chunks and there is "
                        "no group"
                    )
                buffer.copy_(mine)
                self._gathering[unit] = []
            else:
                self._gathering[unit] = [self.group.all_gather_into_async(buffer, mine)]

    def _wait(self, unit: str) -> None:
        handles = self._gathering.pop(unit, ())
        for handle in handles:
            handle.wait()
        packed = self._packed.pop(unit, None)
        if packed is not None:
            buffer = self.buffers[unit]
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
                self.fp8.unpack(self._index[unit], packed, buffer)
        if handles:
            # an asynchronous all_gather_single counts versions when it completes, after
            # _start has returned (torch 2.13, gloo): the version from before it, as in _start
            buffer = self.buffers[unit]
            torch._C._autograd._unsafe_set_version_counter((buffer,), (self._versions[unit],))
