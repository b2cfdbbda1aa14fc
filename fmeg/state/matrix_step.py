"""The matrix optimizers' step on a flat state: each matrix leaf's update computed on the leaf
whole, as one rank would, however the layout splits it.

    step = MatrixStep(pieces, gather, dp_group)
    step.run(flat, master, mu, nu, grad, grad_scale, lr=lr, weight_decay=wd)

A leaf is split three ways: the distributed optimizer (ZeRO-1, FSDP) gives this rank a slice
[lo, hi) of the flat buffers, which may cut a leaf anywhere; tensor (or expert-tensor) parallelism
gives it a block of the leaf's rows or columns; expert parallelism gives it whole experts, which
are whole matrices already. The step (a flat form with momentum_, whole_update, scale and apply_:
fmeg.optim.muon.MuonFlat):

1. steps the momentum on the owned slice, elementwise (what is orthogonalized is elementwise in the
   gradient and the momentum);
2. all-gathers that over the data-parallel group into every leaf's local block (one all-gather of
   the owned slice);
3. all-gathers each local block over its tensor-parallel group into the whole leaf (gather.whole);
4. computes the whole leaf's update on every rank that holds a part of it (tensor-parallel peers
   compute the same matrices: Megatron's "duplicated" mode), takes this rank's part back
   (gather.part) and applies it to the owned slice of the master weights.

Every collective is entered by all ranks of its group in the same order: the data-parallel
all-gather whenever the state has a matrix leaf, the tensor-parallel ones for the leaves
overlapping [lo, hi), which tensor-parallel peers share (their flat layouts are the same).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch


class LeafGather(Protocol):
    """A leaf's local block to the whole leaf and back (fmeg.training.parallel_step's)."""

    def whole(self, path: str, local: torch.Tensor) -> torch.Tensor: ...
    def part(self, path: str, whole: torch.Tensor) -> torch.Tensor: ...


class LocalOnly:
    """One rank's leaves are whole."""

    def whole(self, path: str, local: torch.Tensor) -> torch.Tensor:
        return local

    def part(self, path: str, whole: torch.Tensor) -> torch.Tensor:
        return whole


class MatrixPiece(NamedTuple):
    # "stage.path"
    path: str
    shape: torch.Size
    # where the leaf starts in the flat buffers, its numel
    start: int
    numel: int
    # the owned part [a, b) in owned coordinates
    a: int
    b: int
    decays: bool


class MatrixStep:
    """The matrix leaves of a flat state that overlap its owned slice, and their step."""

    def __init__(
        self, pieces: list[MatrixPiece], gather: LeafGather, dp_group: Any, lo: int, sliced: bool
    ):
        """pieces: the matrix leaves overlapping [lo, hi); sliced: the owned slice is not the whole
        buffer (the distributed optimizer), so it is all-gathered over dp_group first."""
        self.pieces, self.gather, self.dp_group = pieces, gather, dp_group
        self.lo, self.sliced = lo, sliced

    @torch.no_grad()
    def run(
        self,
        flat: Any,
        master: torch.Tensor,
        mu: torch.Tensor,
        nu: torch.Tensor | None,
        grad: torch.Tensor,
        grad_scale: torch.Tensor | None,
        *,
        lr: float,
        weight_decay: float,
    ) -> None:
        owned = torch.zeros_like(master)
        for p in self.pieces:
            owned[p.a : p.b] = flat.momentum_(mu[p.a : p.b], grad[p.a : p.b], grad_scale)
        full = owned
        if self.sliced and self.dp_group is not None:
            full = self.dp_group.all_gather(owned, 0)
        for p in self.pieces:
            local = full[p.start : p.start + p.numel].view(p.shape)
            whole = self.gather.whole(p.path, local)
            update = flat.whole_update(p.path, whole)
            scale = flat.scale(p.path, update) if flat.settings.adaptive else None
            # the owned part of the leaf, in the leaf's flat coordinates
            first, last = p.a + self.lo - p.start, p.b + self.lo - p.start
            mine = self.gather.part(p.path, update).reshape(-1)[first:last]
            scale = None if scale is None else self.gather.part(p.path, scale).reshape(-1)
            flat.apply_(
                master[p.a : p.b],
                None if nu is None else nu[p.a : p.b],
                mine,
                None if scale is None else scale[first:last],
                lr=lr,
                weight_decay=weight_decay,
                decays=p.decays,
            )
