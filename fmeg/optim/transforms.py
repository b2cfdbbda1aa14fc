"""The small gradient transforms AdamW is chained from (fmeg.optim.base's shape), each a pure
function.

    clip_by_global_norm(max_norm)       scale by min(1, max_norm / (norm + 1e-6)); its state keeps
                                        the norm
    scale_by_adam(b1, b2, eps)          Adam's bias-corrected m / (sqrt(v) + eps), the moments
                                        stored in their dtypes
    add_decayed_weights(mask)           + weight_decay * p where mask says (decoupled decay)
    scale_by_learning_rate(decoupled)   * -lr (-decoupled_lr where decoupled says: Megatron's
                                        --decoupled-lr)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmeg import tree
from fmeg.optim.base import GradientTransformation, stateless

Tree = Any
Mask = Callable[[str, torch.Tensor], Any]


class ClipState(NamedTuple):
    # the global norm of the last gradients clipped, 0-d
    norm: torch.Tensor


class AdamState(NamedTuple):
    # steps taken, 0-d int64
    count: torch.Tensor
    # first moment, the structure of params
    mu: Tree
    # second moment
    nu: Tree


def default_decay_mask(path: str, leaf: torch.Tensor) -> bool:
    """Megatron's default: decay matrices and embeddings; skip biases and norm weights."""
    return leaf.dim() > 1 and not path.endswith("bias")


def step_group(
    decoupled: Mask | None, decay_mask: Mask, path: str, leaf: torch.Tensor
) -> tuple[bool, bool]:
    """(takes decoupled_lr?, decays?) for a leaf: what a flat form's one kernel call shares."""
    return bool(decoupled and decoupled(path, leaf)), bool(decay_mask(path, leaf))


def clip_by_global_norm(max_norm: float | None) -> GradientTransformation:
    """Megatron's clip: the updates scaled by min(1, max_norm / (norm + 1e-6)); none for None or 0.
    The scale is a tensor, never a Python branch, so the transform stays traceable."""

    def init(params: Tree) -> ClipState:
        return ClipState(torch.zeros(()))

    def update(updates: Tree, state: ClipState, params: Tree = None, **hyper: Any):
        norm = tree.global_norm(updates)
        if not max_norm:
            return updates, ClipState(norm)
        coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        leaves, spec = tree.tree_flatten(updates)
        return tree.tree_unflatten(torch._foreach_mul(leaves, coeff), spec), ClipState(norm)

    return GradientTransformation(init, update)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    moment_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
) -> GradientTransformation:
    """m_hat / (sqrt(v_hat) + eps) with m, v Adam's moments, computed in fp32 and stored in
    moment_dtypes (None: the parameter's dtype, at least fp32; bf16 is Megatron's precision-aware
    optimizer, which rounds the moments after the step that used them in fp32)."""

    def zeros(params: Tree, dtype: torch.dtype | None) -> Tree:
        return tree.tree_map(
            lambda p: torch.zeros_like(
                p, dtype=dtype or torch.promote_types(p.dtype, torch.float32)
            ),
            params,
        )

    def init(params: Tree) -> AdamState:
        return AdamState(
            torch.zeros((), dtype=torch.int64),
            zeros(params, moment_dtypes[0]),
            zeros(params, moment_dtypes[1]),
        )

    def update(updates: Tree, state: AdamState, params: Tree = None, **hyper: Any):
        g, spec = tree.tree_flatten(updates)
        g = [x.float() for x in g]
        count = state.count + 1
        t = count.to(torch.float64)
        # Three new buffers per leaf (mu, nu, the update); the in-place ops touch only those.
        old_mu, old_nu = tree.tree_leaves(state.mu), tree.tree_leaves(state.nu)
        mu = torch._foreach_lerp([m.float() for m in old_mu], g, 1.0 - b1)
        nu = torch._foreach_mul([v.float() for v in old_nu], b2)
        torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
        out = torch._foreach_sqrt(nu)
        torch._foreach_div_(out, (1.0 - b2**t).sqrt().float())
        torch._foreach_add_(out, eps)
        torch._foreach_reciprocal_(out)
        torch._foreach_mul_(out, mu)
        torch._foreach_div_(out, (1.0 - b1**t).float())

        def stored(new: list, old: list) -> Tree:
            return tree.tree_unflatten([n.to(o.dtype) for n, o in zip(new, old)], spec)

        return tree.tree_unflatten(out, spec), AdamState(
            count, stored(mu, old_mu), stored(nu, old_nu)
        )

    return GradientTransformation(init, update)


def add_decayed_weights(mask: Mask = default_decay_mask) -> GradientTransformation:
    """updates + weight_decay * p (update's weight_decay keyword, default 0) for the leaves
    mask(path, leaf) marks: a bool per leaf, or a 0/1 tensor of the leaf's shape (per element: flat
    ZeRO shards)."""

    def update(updates: Tree, params: Tree, *, weight_decay: Any = 0.0, **hyper: Any) -> Tree:
        leaves, spec = tree.tree_flatten(updates)
        decay = torch.as_tensor(weight_decay, dtype=torch.float32)
        out = []
        for u, (path, p) in zip(leaves, tree.items(params)):
            keep = mask(path, p)
            if isinstance(keep, torch.Tensor):
                u = u + decay * (p * keep)
            elif keep:
                u = u + decay * p
            out.append(u)
        return tree.tree_unflatten(out, spec)

    return stateless(update)


def scale_by_learning_rate(decoupled: Mask | None = None) -> GradientTransformation:
    """updates * -lr; the leaves decoupled(path, leaf) marks take -decoupled_lr when update is given
    one."""

    def update(
        updates: Tree, params: Tree, *, lr: Any, decoupled_lr: Any = None, **hyper: Any
    ) -> Tree:
        leaves, spec = tree.tree_flatten(updates)
        rate = -torch.as_tensor(lr, dtype=torch.float32)
        if decoupled is None or decoupled_lr is None:
            return tree.tree_unflatten(torch._foreach_mul(leaves, rate), spec)
        other = -torch.as_tensor(decoupled_lr, dtype=torch.float32)
        paths = [path for path, _ in tree.items(updates)]
        return tree.tree_unflatten(
            [u * (other if decoupled(path, u) else rate) for u, path in zip(leaves, paths)], spec
        )

    return stateless(update)
