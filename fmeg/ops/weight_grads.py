"""Deferred weight gradients: zero-bubble schedules' split of a backward into B (the input gradient,
on the pipeline's critical path) and W (the weight gradients, run later to fill the bubble).

    with deferrable():                        # forward: the linears record what W will need
        y = ops.linear(x, w)
    pending = []
    with deferring({id(w): "w"}, pending):    # B: dx only; w's gradient deferred
        dx, dw_now = torch.autograd.grad(y, (x, w), g, allow_unused=True)   # dw_now is None
    for path, compute in pending:             # W: the deferred products, one per use
        dw = compute()

A deferrable op's backward calls defer(weight, compute): inside deferring() and for a weight that
is one of the leaves named there, it keeps compute (a closure over the op's input and output
gradient) and returns no gradient for that weight; elsewhere it computes the gradient at once.
Eager only: under torch.compile the ops are torch's own and B computes everything.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

# thread ranks (fmeg.parallel.spmd.run_threads) run executors side by side
_local = threading.local()


@contextlib.contextmanager
def deferrable() -> Iterator[None]:
    """Forward inside uses the deferrable ops (what a split backward needs)."""
    before = getattr(_local, "forward", False)
    _local.forward = True
    try:
        yield
    finally:
        _local.forward = before


def forward_deferrable() -> bool:
    return not torch.compiler.is_compiling() and getattr(_local, "forward", False)


@contextlib.contextmanager
def deferring(paths: dict[int, str], pending: list) -> Iterator[None]:
    """Backward inside defers the gradients of the leaves in paths ({id(leaf): path}) into pending
    as (path, compute) pairs."""
    before = getattr(_local, "backward", None)
    _local.backward = (paths, pending)
    try:
        yield
    finally:
        _local.backward = before


def defer(weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> bool:
    """From a backward: keep weight's gradient for later if deferring() names it (True), else
    leave it to the caller (False)."""
    state = getattr(_local, "backward", None)
    path = None if state is None else state[0].get(id(weight))
    if path is None:
        return False
    state[1].append((path, compute))
    return True


class DeferrableLinear(torch.autograd.Function):
    """ops.linear (x @ w.T + b; a weight of more than two dimensions flattened to its last) whose
    weight gradient may be deferred: the input and bias gradients in backward, w's g.T @ x now or
    in W."""

    @staticmethod
    def forward(x, weight, bias):
        w = weight.flatten(0, -2) if weight.dim() > 2 else weight
        return F.linear(x, w, None if bias is None else bias.flatten())

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.bias_shape = None if bias is None else bias.shape

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w = weight.flatten(0, -2) if weight.dim() > 2 else weight
        dx = grad @ w if ctx.needs_input_grad[0] else None
        db = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
            db = grad.reshape(-1, grad.shape[-1]).sum(0).reshape(ctx.bias_shape)
        dw = None
        if ctx.needs_input_grad[1]:
            shape = weight.shape

            def compute(grad=grad, x=x) -> torch.Tensor:
                g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
                return (g2.t() @ x2).reshape(shape)

            if not defer(weight, compute):
                dw = compute()
        return dx, dw, db
