"""AdamW and global-norm clipping as pure functions over pytrees (optax's shape).

    opt = adamw(b1=0.9, b2=0.999, eps=1e-8)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params, lr=lr, weight_decay=wd)
    params = apply_updates(params, updates)

lr and weight_decay are arguments, not state: schedules are evaluated outside the step (they count
samples, which only the runner knows) and passed in as 0-d tensors, so a compiled step never
recompiles when they change. Nothing is updated in place.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmeg import tree

Tree = Any


class AdamState(NamedTuple):
    count: torch.Tensor  # steps taken, 0-d int64
    mu: Tree  # first moment, same structure and dtype as params
    nu: Tree  # second moment


class Optimizer(NamedTuple):
    init: Callable[[Tree], Any]
    update: Callable[..., tuple[Tree, Any]]


def default_decay_mask(path: str, leaf: torch.Tensor) -> bool:
    """Megatron's default: decay matrices and embeddings; skip biases and norm weights."""
    return leaf.dim() > 1 and not path.endswith("bias")


def adamw(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          decay_mask: Callable[[str, torch.Tensor], Any] = default_decay_mask) -> Optimizer:
    """Adam with bias correction and decoupled weight decay, the update torch.optim.AdamW makes:

        p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * mask * p)

    decay_mask(path, leaf) gives a bool per leaf, or a 0/1 tensor of the leaf's shape (per element).
    """

    def init(params: Tree) -> AdamState:
        zeros = tree.tree_map(torch.zeros_like, params)
        return AdamState(torch.zeros((), dtype=torch.int64), zeros, tree.tree_map(torch.zeros_like, params))

    def update(grads: Tree, state: AdamState, params: Tree, *, lr: Any, weight_decay: Any = 0.0):
        g, spec = tree.tree_flatten(grads)
        count = state.count + 1
        t = count.to(torch.float64)
        lr = torch.as_tensor(lr, dtype=torch.float64)
        step_size = (-lr / (1.0 - b1**t)).float()
        decay = (-lr * torch.as_tensor(weight_decay, dtype=torch.float64)).float()
        # Three new buffers per leaf (mu, nu, updates); the in-place ops below touch only those, never
        # an argument. Fewer fresh buffers matter: each costs a pass of page faults on CPU.
        mu = torch._foreach_lerp(tree.tree_leaves(state.mu), g, 1.0 - b1)
        nu = torch._foreach_mul(tree.tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
        updates = torch._foreach_sqrt(nu)
        torch._foreach_div_(updates, (1.0 - b2**t).sqrt().float())
        torch._foreach_add_(updates, eps)
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, mu)
        torch._foreach_mul_(updates, step_size)
        for u, (path, p) in zip(updates, tree.items(params)):
            keep = decay_mask(path, p)
            if isinstance(keep, torch.Tensor):  # an elementwise mask (flat ZeRO shards)
                u.addcmul_(p * keep, decay)
            elif keep:
                u.addcmul_(p, decay)
        unflat = lambda leaves: tree.tree_unflatten(leaves, spec)  # noqa: E731
        return unflat(updates), AdamState(count, unflat(mu), unflat(nu))

    return Optimizer(init, update)


def apply_updates(params: Tree, updates: Tree) -> Tree:
    """params + updates, leaf by leaf, in each parameter's dtype."""
    leaves, spec = tree.tree_flatten(params)
    new = torch._foreach_add(leaves, [u.to(p.dtype) for u, p in zip(tree.tree_leaves(updates), leaves)])
    return tree.tree_unflatten(new, spec)


def clip_by_global_norm(grads: Tree, max_norm: float | None) -> tuple[Tree, torch.Tensor]:
    """(grads scaled by min(1, max_norm / (norm + 1e-6)), norm), Megatron's clip; no clip for None or 0.

    The scale is a tensor, never a Python branch, so the function stays traceable.
    """
    norm = tree.global_norm(grads)
    if not max_norm:
        return grads, norm
    coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    leaves, spec = tree.tree_flatten(grads)
    return tree.tree_unflatten(torch._foreach_mul(leaves, coeff), spec), norm
