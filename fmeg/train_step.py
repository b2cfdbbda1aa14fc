"""One training step as a pure function: (params, opt_state, batch, hyperparameters) -> new ones.

    step = make_train_step(partial(gpt.loss, config=config), optim.adamw(), clip_grad=1.0)
    params, opt_state, metrics = step(params, opt_state, batch, lr, weight_decay, key)

Gradients come from torch.func.grad_and_value; nothing is mutated, so the same function runs eagerly
or under torch.compile (compile_train_step) and gives the same numbers within rounding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fmeg.optim import Optimizer, apply_updates, clip_by_global_norm

LossFn = Callable[..., torch.Tensor]  # loss_fn(params, batch, key=...) -> scalar


def make_train_step(loss_fn: LossFn, optimizer: Optimizer, *, clip_grad: float | None = None) -> Callable:
    """A step computing grads of loss_fn, clipping their global norm, and applying the optimizer.

    lr and weight_decay should be 0-d tensors (a Python float is baked into a compiled graph), and key
    a 0-d int64 tensor or None (no dropout). metrics holds the loss and the pre-clip gradient norm.
    """
    grad_and_loss = torch.func.grad_and_value(loss_fn)

    def train_step(params: Any, opt_state: Any, batch: dict, lr: Any, weight_decay: Any = 0.0, key: Any = None):
        grads, loss = grad_and_loss(params, batch, key=key)
        grads, grad_norm = clip_by_global_norm(grads, clip_grad)
        updates, opt_state = optimizer.update(grads, opt_state, params, lr=lr, weight_decay=weight_decay)
        return apply_updates(params, updates), opt_state, {"loss": loss.detach(), "grad_norm": grad_norm.detach()}

    return train_step


def compile_train_step(step: Callable, **compile_options: Any) -> Callable:
    """torch.compile around a whole train step (forward, backward and optimizer in one graph)."""
    return torch.compile(step, **compile_options)
