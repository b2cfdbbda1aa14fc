"""Recomputation inside a function: keep a piece's inputs, run it again in backward (Megatron's selective
activation recomputation applies it to the attention core)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint


class _Recomputed(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(fn: Callable, *args: torch.Tensor) -> torch.Tensor:
        return fn(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.fn = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx, grad):
        _, vjp = torch.func.vjp(ctx.fn, *ctx.saved_tensors)
        return (None, *vjp(grad))


def recomputed(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), keeping only args for backward, where fn runs again (fn must be deterministic: dropout
    here is counter-based). Works under autograd and torch.func's grad, vjp and vmap; under torch.compile
    it is torch.utils.checkpoint, which the compiler turns into recomputation in the backward graph."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return _Recomputed.apply(fn, *args)
