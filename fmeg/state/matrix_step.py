"""The matrix optimizers' step on a flat state (Muon, SOAP): each matrix leaf's update computed on
the leaf whole, as one rank would, however the layout splits it, at a home rank.

    step = MatrixStep(leaves, pieces, gather, dp_group, dp, dp_rank, layout, sliced)
    step.run(flat, master, mu, nu, grad, grad_scale, lr=lr, weight_decay=wd)

A leaf is split three ways: the distributed optimizer (ZeRO-1, FSDP) gives this rank a chunk of
each unit of the flat buffers (zero.FlatBuffer), which may cut a leaf anywhere; tensor (or
expert-tensor) parallelism gives it a block of the leaf's rows or columns; expert parallelism gives
it whole experts, which are whole matrices already. With a flat form that has prepare_, whole_step,
apply_ (and scale for adaptive Muon: fmeg.optim.muon.MuonFlat, fmeg.optim.soap.SoapFlat) the step:

1. prepares the owned slice elementwise (Muon: steps the momentum; SOAP: the unclipped gradient);
2. all-gathers it over the data-parallel group (one all-gather, laid out flat again), so every
   rank has its blocks of every leaf;
3. at each leaf's home (one data-parallel rank per leaf, spread by size so the work balances; with
   the buffers whole, every rank), gathers the block over its tensor-parallel group into the whole
   leaf (gather.whole; tensor-parallel peers share a home and compute alike: Megatron's
   "duplicated" mode), computes the whole leaf's direction, keeping the leaf's state there (SOAP's
   factors, bases and moments), and writes its block of the direction into a buffer of zeros;
4. reduce-scatters that buffer over the data-parallel group (one reduce-scatter: each element has
   one non-zero contribution, so the sum is exact), and applies the owned slice of it.

Every collective is entered by all ranks of its group in the same order.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from fmeg import tree


class LeafGather(Protocol):
    """A leaf's local block to the whole leaf and back (fmeg.training.optimizers')."""

    def whole(self, path: str, local: torch.Tensor) -> torch.Tensor: ...
    def part(self, path: str, whole: torch.Tensor) -> torch.Tensor: ...
    def whole_shape(self, path: str, shape: tuple[int, ...]) -> tuple[int, ...]: ...
    def replica_axes(self, path: str, sliced: bool) -> list[str]: ...


class LocalOnly:
    """One rank's leaves are whole."""

    def whole(self, path: str, local: torch.Tensor) -> torch.Tensor:
        return local

    def part(self, path: str, whole: torch.Tensor) -> torch.Tensor:
        return whole

    def whole_shape(self, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape)

    def replica_axes(self, path: str, sliced: bool) -> list[str]:
        return []


class MatrixLeaf(NamedTuple):
    # "stage.path"
    path: str
    shape: torch.Size
    # where the leaf starts in the flat buffers, its numel
    start: int
    numel: int
    decays: bool


class MatrixPiece(NamedTuple):
    leaf: MatrixLeaf
    # the owned part [a, b) in owned coordinates
    a: int
    b: int
    # where a is in the flat buffers
    at: int


def homes(leaves: list[MatrixLeaf], ranks: int) -> list[int]:
    """The data-parallel rank computing each leaf: the largest first, each to the least loaded
    rank (the same answer on every rank)."""
    load, out = [0] * ranks, [0] * len(leaves)
    for i in sorted(range(len(leaves)), key=lambda i: (-leaves[i].numel, i)):
        out[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[out[i]] += leaves[i].numel
    return out


class MatrixStep:
    """The matrix leaves of a flat state, their step, and the states their homes keep."""

    def __init__(
        self,
        leaves: list[MatrixLeaf],
        pieces: list[MatrixPiece],
        gather: LeafGather,
        dp_group: Any,
        dp: int,
        dp_rank: int,
        layout: Any,
        sliced: bool,
    ):
        """leaves: every matrix leaf of the state; pieces: their owned parts; layout: the flat
        buffers' (zero.FlatBuffer); sliced: the owned elements are not the whole buffer (the
        distributed optimizer): the work is spread over the dp ranks, else every rank computes
        every leaf."""
        self.leaves, self.pieces, self.gather, self.dp_group = leaves, pieces, gather, dp_group
        self.layout, self.sliced = layout, sliced and dp > 1
        home = homes(leaves, dp) if self.sliced else [dp_rank] * len(leaves)
        self.mine = [leaf for leaf, h in zip(leaves, home) if h == dp_rank]
        # each home leaf's state ({path: the flat form's state}), None until its first step
        self.states: dict[str, Any] = {leaf.path: None for leaf in self.mine}

    @classmethod
    def of(
        cls,
        flat: Any,
        params: dict[int, Any],
        where: dict[str, tuple[int, int]],
        owned: list[tuple[str, torch.Tensor, int, int, int]],
        *,
        gather: LeafGather,
        dp_group: Any,
        dp: int,
        dp_rank: int,
        layout: Any,
        sliced: bool,
        device: Any,
    ) -> "MatrixStep":
        """The step of a flat state's matrix leaves (its flat form's group "muon"): where: each
        leaf's (flat start, numel); owned: the (path, leaf, a, b, flat a) owned parts of the leaves.
        A flat form that keeps a state per matrix (SOAP's) has it made for the leaves computed
        here."""
        leaves = [
            MatrixLeaf(path, leaf.shape, *where[path], bool(flat.decay_mask(path, leaf)))
            for path, leaf in tree.items(params)
            if flat.group(path, leaf) == "muon"
        ]
        by_path = {leaf.path: leaf for leaf in leaves}
        pieces = [
            MatrixPiece(by_path[path], a, b, at) for path, _, a, b, at in owned if path in by_path
        ]
        step = cls(leaves, pieces, gather, dp_group, dp, dp_rank, layout, sliced)
        if getattr(flat, "keeps_matrix_state", False):
            step.fresh_states(flat, device)
        return step

    def fresh_states(self, flat: Any, device: Any) -> None:
        """The states of the leaves computed here before any step (what a checkpoint fills)."""
        for leaf in self.mine:
            whole = self.gather.whole_shape(leaf.path, tuple(leaf.shape))
            self.states[leaf.path] = flat.fresh_state(leaf.path, whole, device)

    def held_states(self) -> dict[str, tuple[Any, list[str]]]:
        """{path: (its state, the mesh axes of the ranks holding it alike)}."""
        return {
            path: (state, self.gather.replica_axes(path, self.sliced))
            for path, state in self.states.items()
            if state is not None
        }

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
        owned = torch.zeros(mu.shape, device=mu.device)
        for p in self.pieces:
            owned[p.a : p.b] = flat.prepare_(mu[p.a : p.b], grad[p.a : p.b], grad_scale)
        full = self.layout.unshard(self.dp_group.all_gather(owned, 0)) if self.sliced else owned
        out = torch.zeros_like(full)
        for leaf in self.mine:
            local = full[leaf.start : leaf.start + leaf.numel].view(leaf.shape)
            whole = self.gather.whole(leaf.path, local)
            update, self.states[leaf.path] = flat.whole_step(
                leaf.path, whole, self.states[leaf.path]
            )
            block = self.gather.part(leaf.path, update)
            out[leaf.start : leaf.start + leaf.numel] = block.flatten()
        mine = self.dp_group.reduce_scatter(self.layout.by_rank(out), 0) if self.sliced else out
        for p in self.pieces:
            leaf, scale = p.leaf, None
            if getattr(flat.settings, "adaptive", None):
                shape = self.gather.whole_shape(leaf.path, tuple(leaf.shape))
                whole = flat.scale(leaf.path, torch.empty(shape, device=mu.device))
                first = p.at - leaf.start
                scale = self.gather.part(leaf.path, whole).flatten()[first : first + p.b - p.a]
            flat.apply_(
                master[p.a : p.b],
                None if nu is None else nu[p.a : p.b],
                mine[p.a : p.b],
                scale,
                lr=lr,
                weight_decay=weight_decay,
                decays=leaf.decays,
            )
