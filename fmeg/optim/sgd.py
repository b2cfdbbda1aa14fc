"""SGD with momentum and Lion, Megatron's --optimizer sgd and lion, in two forms each: transforms
over pytrees and the same update over the runner's flat buffers.

    sgd(momentum=0.9)       torch.optim.SGD's update (Megatron builds its SGD from it): the
                            weight decay coupled (added to the gradient), b <- momentum b + g,
                            p <- p - lr b
    lion(b1=0.95, b2=0.98)  emerging-optimizers' Lion on every leaf: p <- p (1 - lr wd) -
                            lr sign(b1 m + (1 - b1) g), then m <- b2 m + (1 - b2) g (Megatron's
                            --muon-scalar-optimizer lion, --lion-beta1/2)
    lion_on_matrices(b1=0.9, b2=0.999, scalar=adamw())
                            Megatron's --optimizer lion (its emerging-optimizer path): that Lion,
                            with --adam-beta1/2, on the matrices; scalar (Adam) on the
                            embeddings, the output layer, norms and biases

sgd and lion keep one buffer per parameter (mu); lion_on_matrices keeps Adam's second moment (nu)
too. The decay mask is Megatron's (adamw's): no decay on biases and norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from fmeg import tree
from fmeg.optim.adam import adamw
from fmeg.optim.base import GradientTransformation, chain, without_stage
from fmeg.optim.matrix_flat import matrices_and_the_rest
from fmeg.optim.muon import LeafMatrices, TwoDimensional
from fmeg.optim.transforms import (
    Mask,
    add_decayed_weights,
    default_decay_mask,
    scale_by_learning_rate,
    step_group,
)

Tree = Any


class MomentumState(NamedTuple):
    # steps taken, 0-d int64
    count: torch.Tensor
    # the one buffer per parameter
    mu: Tree


def _zeros(params: Tree) -> Tree:
    return tree.tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params)


def trace(momentum: float) -> GradientTransformation:
    """b <- momentum * b + g; the update is b (torch.optim.SGD's heavy-ball momentum)."""

    def init(params: Tree) -> MomentumState:
        return MomentumState(torch.zeros((), dtype=torch.int64), _zeros(params))

    def update(updates: Tree, state: MomentumState, params: Tree = None, **hyper: Any):
        g, spec = tree.tree_flatten(updates)
        mu = torch._foreach_mul(tree.tree_leaves(state.mu), momentum)
        torch._foreach_add_(mu, [x.float() for x in g])
        new = tree.tree_unflatten(mu, spec)
        return new, MomentumState(state.count + 1, new)

    return GradientTransformation(init, update)


def scale_by_lion(b1: float = 0.95, b2: float = 0.98) -> GradientTransformation:
    """sign(b1 m + (1 - b1) g), then m <- b2 m + (1 - b2) g."""

    def init(params: Tree) -> MomentumState:
        return MomentumState(torch.zeros((), dtype=torch.int64), _zeros(params))

    def update(updates: Tree, state: MomentumState, params: Tree = None, **hyper: Any):
        g, spec = tree.tree_flatten(updates)
        g = [x.float() for x in g]
        old = tree.tree_leaves(state.mu)
        out = [torch.sign(m.lerp(x, 1 - b1)) for m, x in zip(old, g)]
        mu = [m.lerp(x, 1 - b2) for m, x in zip(old, g)]
        return tree.tree_unflatten(out, spec), MomentumState(
            state.count + 1, tree.tree_unflatten(mu, spec)
        )

    return GradientTransformation(init, update)


class ElementwiseFlat(NamedTuple):
    """sgd's or lion's update over flat fp32 buffers, in place, one foreach pass per group of leaves
    sharing (decoupled lr?, decays?). views: [master, grad, mu, nu] lists (nu unused)."""

    rule: str
    b1: float
    b2: float
    decay_mask: Mask
    decoupled: Mask | None
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    # the flat buffers this form reads: mu only
    kinds: tuple[str, ...] = ("mu",)

    @property
    def name(self) -> str:
        return self.rule

    def group(self, path: str, leaf: torch.Tensor) -> tuple[bool, bool]:
        return step_group(self.decoupled, self.decay_mask, path, leaf)

    def step_(
        self,
        views: list[list[torch.Tensor]],
        steps: list[torch.Tensor],
        group: tuple[bool, bool],
        *,
        lr: float,
        weight_decay: float,
        decoupled_lr: float | None = None,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        master, grad, mu = views[:3]
        decoupled, decays = group
        rate = decoupled_lr if decoupled and decoupled_lr is not None else lr
        wd = weight_decay if decays else 0.0
        g = torch._foreach_div(grad, grad_scale) if grad_scale is not None else list(grad)
        if self.rule == "sgd":
            if wd:
                g = torch._foreach_add(g, master, alpha=wd)
            torch._foreach_mul_(mu, self.b1)
            torch._foreach_add_(mu, g)
            torch._foreach_add_(master, mu, alpha=-rate)
            return
        update = torch._foreach_sign(torch._foreach_lerp(mu, g, 1 - self.b1))
        torch._foreach_lerp_(mu, g, 1 - self.b2)
        if wd:
            torch._foreach_mul_(master, 1 - rate * wd)
        torch._foreach_add_(master, update, alpha=-rate)


def sgd(
    momentum: float = 0.9, decay_mask: Mask = default_decay_mask, decoupled: Mask | None = None
) -> GradientTransformation:
    """torch.optim.SGD with momentum and coupled weight decay where decay_mask says; decoupled:
    the leaves update's decoupled_lr applies to."""
    pytree = chain(
        add_decayed_weights(decay_mask), trace(momentum), scale_by_learning_rate(decoupled)
    )
    return pytree._replace(flat=ElementwiseFlat("sgd", momentum, 0.0, decay_mask, decoupled))


def lion(
    b1: float = 0.95,
    b2: float = 0.98,
    decay_mask: Mask = default_decay_mask,
    decoupled: Mask | None = None,
) -> GradientTransformation:
    """emerging-optimizers' Lion with decoupled weight decay where decay_mask says."""
    pytree = chain(
        scale_by_lion(b1, b2), add_decayed_weights(decay_mask), scale_by_learning_rate(decoupled)
    )
    return pytree._replace(flat=ElementwiseFlat("lion", b1, b2, decay_mask, decoupled))


@dataclass(frozen=True)
class LionOnMatricesFlat:
    """lion_on_matrices' update over the runner's flat buffers: the matrix leaves by Lion's flat
    form, the others by the scalar optimizer's, each group of leaves by one of them (groups
    ("lion", Lion's group) and ("scalar", the scalar optimizer's group))."""

    lion: ElementwiseFlat
    scalar: Any
    matrices: LeafMatrices
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    kinds: ClassVar[tuple[str, ...]] = ("mu", "nu")
    name: ClassVar[str] = "lion"

    def group(self, path: str, leaf: torch.Tensor) -> tuple[str, Any]:
        if self.matrices.is_matrix(without_stage(path), leaf):
            return "lion", self.lion.group(path, leaf)
        return "scalar", self.scalar.group(path, leaf)

    def step_(self, views, steps, group: tuple[str, Any], **hyper: Any) -> None:
        which, inner = group
        (self.lion if which == "lion" else self.scalar).step_(views, steps, inner, **hyper)


def lion_on_matrices(
    b1: float = 0.9,
    b2: float = 0.999,
    scalar: GradientTransformation | None = None,
    matrices: LeafMatrices = TwoDimensional(),
    decay_mask: Mask = default_decay_mask,
) -> GradientTransformation:
    """emerging-optimizers' Lion (decoupled weight decay where decay_mask says) on
    matrices.is_matrix's leaves, scalar (default: adamw(b1, b2)) on the others."""
    scalar = adamw(b1, b2, decay_mask=decay_mask) if scalar is None else scalar
    flat = LionOnMatricesFlat(
        ElementwiseFlat("lion", b1, b2, decay_mask, None), scalar.flat, matrices
    )
    direction = scale_by_lion(b1, b2)
    return matrices_and_the_rest("lion", direction, scalar, matrices, decay_mask, flat)
