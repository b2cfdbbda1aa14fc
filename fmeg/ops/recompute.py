"""Recomputation inside a function: keep a piece's inputs, run it again in backward (Megatron's
selective activation recomputation, --recompute-modules: the attention core, norms, MLPs, experts,
MLA's up-projections)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree


class _Recomputed(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(fn: Callable, *args: torch.Tensor) -> Any:
        return fn(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.fn = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, *grads):
        _, vjp = torch.func.vjp(ctx.fn, *ctx.saved_tensors)
        return (None, *vjp(grads if len(grads) > 1 else grads[0]))


def recomputed(fn: Callable[..., Any], *args: torch.Tensor) -> Any:
    """fn(*args) (a tensor or a tuple of tensors), keeping only args for backward, where fn runs
    again (fn must be deterministic: dropout here is counter-based; collectives inside it run again
    on every rank alike). Gradients reach args only: whatever fn closes over is a constant. Works
    under autograd and torch.func's grad, vjp and vmap; under torch.compile it is
    torch.utils.checkpoint, which the compiler turns into recomputation in the backward graph."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return _Recomputed.apply(fn, *args)


def recomputed_with(fn: Callable[..., Any], params: Any, *xs: torch.Tensor) -> Any:
    """fn(params, *xs) recomputed in backward, params (a pytree of tensors) passed as inputs so that
    they get their gradients."""
    leaves, spec = pytree.tree_flatten(params)

    def run(*args: torch.Tensor) -> Any:
        return fn(pytree.tree_unflatten(list(args[len(xs) :]), spec), *args[: len(xs)])

    return recomputed(run, *xs, *leaves)
