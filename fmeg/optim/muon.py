"""Muon and adaptive Muon (Megatron's --optimizer muon / adaptive_muon, emerging-optimizers'
definitions): the matrices by momentum and Newton-Schulz orthogonalization, every other leaf
(embeddings, the output layer, norms, biases) by the scalar optimizer, Adam or Lion
(--muon-scalar-optimizer).

    opt = muon(MuonSettings(momentum=0.9), scalar=adamw(), matrices=TwoDimensional())
    state = opt.init(params)
    updates, state = opt.update(grads, state, params, lr=lr, weight_decay=wd)

For a matrix leaf W with gradient g and momentum buffer m:

    m <- momentum m + (1 - momentum) g          (an EMA, as emerging-optimizers' Muon)
    x = (1 - momentum) g + momentum m  if nesterov else m
    W <- W (1 - lr wd) - lr * extra * scale(rows, cols) * newton_schulz(x)

each of the leaf's matrices (matrices.split: q, k and v apart, one per expert) orthogonalized
whole. Adaptive Muon (adamuon) then divides elementwise by the root of an EMA v of the update's
squares and scales once more, as Megatron's TensorParallelAdaptiveMuon does:
u = s o, v <- b2 v + (1 - b2) u^2, update = s u / (sqrt(v) + eps).

The flat form (MuonFlat) is the same update over the runner's buffers: whole_step() is what one
rank computes for a whole leaf; the training state gathers each leaf whole however tp, ep, ZeRO
or FSDP split it (fmeg.state.matrix_step), so every layout takes one rank's step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from fmeg import tree
from fmeg.optim.adam import adamw
from fmeg.optim.base import GradientTransformation, without_stage
from fmeg.optim.matrix_flat import MatrixFlat, matrices_and_the_rest
from fmeg.optim.newton_schulz import newton_schulz, scale_factor
from fmeg.optim.transforms import Mask, default_decay_mask

Tree = Any


class LeafMatrices(Protocol):
    """Which leaves Muon steps, the 2-D parameters a whole leaf holds (split; join is its inverse),
    and the blocks of rows of a parameter orthogonalized apart (row_blocks; None: all of it)."""

    def is_matrix(self, path: str, leaf: torch.Tensor) -> bool: ...
    def split(self, path: str, whole: torch.Tensor) -> list[torch.Tensor]: ...
    def join(self, path: str, parts: list[torch.Tensor], whole: torch.Tensor) -> torch.Tensor: ...
    def row_blocks(self, path: str, rows: int) -> list[torch.Tensor] | None: ...


class TwoDimensional:
    """Every 2-D leaf is one matrix; the rest go to the scalar optimizer."""

    def is_matrix(self, path: str, leaf: torch.Tensor) -> bool:
        return leaf.dim() == 2

    def split(self, path: str, whole: torch.Tensor) -> list[torch.Tensor]:
        return [whole]

    def join(self, path: str, parts: list[torch.Tensor], whole: torch.Tensor) -> torch.Tensor:
        return parts[0]

    def row_blocks(self, path: str, rows: int) -> list[torch.Tensor] | None:
        return None


class MuonSettings(NamedTuple):
    """Megatron's --muon-* flags (its defaults), and adaptive Muon's moment."""

    momentum: float = 0.9
    nesterov: bool = False
    num_ns_steps: int = 5
    coefficient_type: str = "quintic"
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    # --muon-fp32-matmul-prec medium: the iterations in bf16
    bf16: bool = True
    # adaptive Muon (adamuon): (beta2, eps); None: Muon
    adaptive: tuple[float, float] | None = None


def _scaled(m: torch.Tensor, s: MuonSettings) -> torch.Tensor:
    o = newton_schulz(m, s.num_ns_steps, s.coefficient_type, s.bf16)
    return o * (scale_factor(*m.shape, s.scale_mode) * s.extra_scale_factor)


def orthogonalized(
    x: torch.Tensor, path: str, matrices: LeafMatrices, s: MuonSettings
) -> torch.Tensor:
    """A whole leaf's Muon direction: each of its parameters (each block of rows of one, where
    row_blocks says) orthogonalized and scaled."""
    parts = []
    for m in matrices.split(path, x):
        blocks = matrices.row_blocks(path, m.shape[0])
        if blocks is None:
            parts.append(_scaled(m, s))
            continue
        o = torch.empty_like(m)
        for rows in blocks:
            o[rows] = _scaled(m[rows], s)
        parts.append(o)
    return matrices.join(path, parts, x)


def adaptive_scale(
    path: str, matrices: LeafMatrices, s: MuonSettings, whole: torch.Tensor
) -> torch.Tensor:
    """The factor adaptive Muon multiplies its normalized update by, per element of the whole leaf:
    the scale of the parameter's whole shape (Megatron's AdaptiveMuon._apply_muon_scale), whatever
    blocks its rows were orthogonalized in."""
    parts = [
        torch.full_like(m, scale_factor(*m.shape, s.scale_mode) * s.extra_scale_factor)
        for m in matrices.split(path, whole)
    ]
    return matrices.join(path, parts, whole)


class MuonState(NamedTuple):
    count: torch.Tensor
    # the momentum buffer of each matrix leaf
    mu: Tree
    # adaptive Muon's second moment (None for Muon)
    nu: Tree


def scale_by_muon(s: MuonSettings, matrices: LeafMatrices) -> GradientTransformation:
    """The Muon direction of each leaf of a tree of matrix leaves ({path: leaf})."""

    def init(params: Tree) -> MuonState:
        zeros = tree.tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params)
        nu = tree.tree_map(torch.zeros_like, zeros) if s.adaptive else None
        return MuonState(torch.zeros((), dtype=torch.int64), zeros, nu)

    def update(updates: Tree, state: MuonState, params: Tree = None, **hyper: Any):
        out, mus, nus = {}, {}, {}
        for path, g in updates.items():
            g = g.float()
            mu = state.mu[path].lerp(g, 1 - s.momentum)
            x = g.lerp(mu, s.momentum) if s.nesterov else mu
            o = orthogonalized(x, path, matrices, s)
            if s.adaptive:
                b2, eps = s.adaptive
                nus[path] = state.nu[path].lerp(o.square(), 1 - b2)
                o = o / (nus[path].sqrt() + eps) * adaptive_scale(path, matrices, s, o)
            out[path], mus[path] = o, mu
        return out, MuonState(state.count + 1, mus, nus if s.adaptive else None)

    return GradientTransformation(init, update)


@dataclass(frozen=True)
class MuonFlat(MatrixFlat):
    """muon's update over the runner's flat buffers: the scalar leaves by the scalar optimizer's
    flat form (its groups); the matrix leaves (group "muon") by prepare_() on the owned slice,
    whole_step() on each leaf gathered whole, and apply_() on the owned slice again. Muon's
    momentum shares mu with the scalar optimizer's first moment; nu is the scalar Adam's second
    moment and adaptive Muon's."""

    @property
    def name(self) -> str:
        return "adaptive_muon" if self.settings.adaptive else "muon"

    @property
    def kinds(self) -> tuple[str, ...]:
        inner = getattr(self.scalar, "kinds", ("mu", "nu"))
        return ("mu", "nu") if self.settings.adaptive or "nu" in inner else ("mu",)

    @property
    def matrix_kinds(self) -> tuple[str, ...]:
        """Muon's momentum; adaptive Muon's second moment too."""
        return ("mu", "nu") if self.settings.adaptive else ("mu",)

    def prepare_(
        self, mu: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """The momentum buffer (a piece of mu) stepped in place by the gradient divided by
        grad_scale; returns what is orthogonalized."""
        g = grad / grad_scale if grad_scale is not None else grad
        mu.lerp_(g, 1 - self.settings.momentum)
        return g.lerp(mu, self.settings.momentum) if self.settings.nesterov else mu.clone()

    def whole_step(self, path: str, x: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """The whole leaf's direction (before adaptive Muon's moment), from its whole x; Muon
        keeps no state per matrix."""
        return orthogonalized(x, without_stage(path), self.matrices, self.settings), None

    def scale(self, path: str, whole: torch.Tensor) -> torch.Tensor:
        return adaptive_scale(without_stage(path), self.matrices, self.settings, whole)

    def apply_(
        self,
        master: torch.Tensor,
        nu: torch.Tensor,
        update: torch.Tensor,
        scale: torch.Tensor | None,
        *,
        lr: float,
        weight_decay: float,
        decays: bool,
    ) -> None:
        """MatrixFlat's, adaptive Muon's direction first normalized by nu (stepped in place) and
        multiplied by scale."""
        if self.settings.adaptive:
            b2, eps = self.settings.adaptive
            nu.lerp_(update.square(), 1 - b2)
            update = update / (nu.sqrt() + eps) * scale
        super().apply_(master, nu, update, scale, lr=lr, weight_decay=weight_decay, decays=decays)


def muon(
    settings: MuonSettings = MuonSettings(),
    scalar: GradientTransformation | None = None,
    matrices: LeafMatrices = TwoDimensional(),
    decay_mask: Mask = default_decay_mask,
) -> GradientTransformation:
    """Muon on matrices.is_matrix's leaves (decoupled weight decay where decay_mask says), scalar
    (default: adamw()) on the others."""
    scalar = adamw(decay_mask=decay_mask) if scalar is None else scalar
    flat = MuonFlat(settings, matrices, scalar.flat, decay_mask)
    direction = scale_by_muon(settings, matrices)
    return matrices_and_the_rest("muon", direction, scalar, matrices, decay_mask, flat)
