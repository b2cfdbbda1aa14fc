"""--deterministic-mode's tensor-parallel regions: every sum that tensor parallelism splits over
its ranks is taken as a fixed set of pieces, each computed alone (the same GEMM of the same shape
at every layout), and the pieces are summed exactly (fmeg.parallel.exact), so the result does not
depend on which rank holds which piece, nor on how many ranks there are.

| function                  | forward                          | backward                        |
|---------------------------|----------------------------------|---------------------------------|
| exact_reduce(pieces, g)   | exact sum over pieces and ranks  | the gradient to every piece     |
| exact_copy(x, n, g)       | x repeated as n pieces           | exact sum of the pieces' grads  |
| per_token(p, x, g)        | p repeated to x's tokens         | exact sum over tokens and ranks |
| column_linear(x, w, b...) | x @ w.T, a piece of rows at once | input's gradient by exact_copy  |
| row_linear(x, w, n, g)    | n pieces of the inner dimension  | each piece's gradients alone    |

The pieces are fixed by the whole dimension, not the layout: PIECES of it (or of its largest
divisor, gcd(PIECES * t, dim)), so any tp dividing PIECES holds whole pieces and gives one rank's
bits. Vocabulary rows are cut into pieces of VOCAB_ROWS rows (the padded vocabulary grows with tp;
its extra pieces are exact zeros). Sums are scaled for COUNT operands, a bound on any of them, so
that zero pieces change no bit.

Sharding contract: exact_reduce's pieces are this rank's share of the summed pieces [n, ...], the
result replicated over the group; exact_copy's x is replicated. A group of None is one rank (the
sums are exact still: one rank's bits are the reference). Both are linear, so their jvp applies
the forward to the tangent; their vmap rules move the batch dimension behind the pieces'.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fmeg.parallel.exact import fixed_point_sum

# the largest tp whose runs give one rank's bits (any tp dividing it)
PIECES = 8
# rows of a vocabulary piece: Megatron pads the vocabulary to a multiple of 128 * tp
VOCAB_ROWS = 128
# the scale's bound on a sum's operands (2^38 below the largest survive, finer than fp32)
COUNT = 2**24


class _ExactReduce(torch.autograd.Function):
    @staticmethod
    def forward(pieces, group):
        return fixed_point_sum(pieces, 0, group, COUNT)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n, ctx.group = inputs[0].shape[0], inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(0).expand(ctx.n, *grad.shape), None

    @staticmethod
    def jvp(ctx, pieces_t, _group_t):
        return fixed_point_sum(pieces_t, 0, ctx.group, COUNT)

    @staticmethod
    def vmap(info, in_dims, pieces, group):
        if in_dims[0] is None:
            return _ExactReduce.apply(pieces, group), None
        return _ExactReduce.apply(pieces.movedim(in_dims[0], 1), group), 0


class _ExactCopy(torch.autograd.Function):
    @staticmethod
    def forward(x, n, group):
        return x.unsqueeze(0).expand(n, *x.shape).clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.n, ctx.group = inputs

    @staticmethod
    def backward(ctx, grad):
        return fixed_point_sum(grad, 0, ctx.group, COUNT), None, None

    @staticmethod
    def jvp(ctx, x_t, _n_t, _group_t):
        return x_t.unsqueeze(0).expand(ctx.n, *x_t.shape).clone()

    @staticmethod
    def vmap(info, in_dims, x, n, group):
        if in_dims[0] is None:
            return _ExactCopy.apply(x, n, group), None
        return _ExactCopy.apply(x.movedim(in_dims[0], 0), n, group), 1


def exact_reduce(pieces: torch.Tensor, group: Any) -> torch.Tensor:
    """pieces [n, ...] (this rank's) summed over n and the group's ranks, exactly; the backward
    hands each piece the whole gradient (Megatron's reduce_from, piece by piece)."""
    return _ExactReduce.apply(pieces, group)


def exact_copy(x: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """x [...] replicated -> [n, ...], one copy a piece; the backward sums the pieces' gradients
    over n and the group's ranks, exactly (Megatron's copy_to, piece by piece)."""
    return _ExactCopy.apply(x, n, group)


def per_token(p: torch.Tensor, x: torch.Tensor, group: Any) -> torch.Tensor:
    """A replicated parameter p [*P] applied to every token of x [..., *P]: p repeated to x's
    shape, its gradient the exact sum over the tokens and over group (the ranks that split the
    tokens, or None)."""
    n = x.numel() // p.numel()
    return exact_copy(p, n, group).reshape(x.shape)


def pieces_held(dim_held: int, tp_size: int, rows: int | None = None) -> int:
    """How many pieces this rank's dim_held elements of a split dimension make: whole pieces of
    the whole dimension (rows: fixed-size pieces of that many elements, the vocabulary's)."""
    if rows is not None:
        return dim_held // math.gcd(dim_held, rows)
    whole = math.gcd(PIECES * tp_size // math.gcd(PIECES, tp_size), dim_held * tp_size)
    return whole // tp_size


def column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int, group: Any
) -> torch.Tensor:
    """x [..., in] replicated, weight [..., rows/t, in] (its rows split over tp) -> y [..., out/t]
    (the leading dims and rows flattened, as ops.linear): n pieces of rows, each GEMM'd alone;
    the input gradient, a sum over the rows of every rank, summed exactly by exact_copy."""
    *lead, rows, k = weight.shape
    width = rows // n

    def by_piece(t: torch.Tensor) -> torch.Tensor:
        # [..., rows] -> [n, lead * width, ...]: piece j holds rows j*width.. of every slice
        return t.reshape(*lead, n, width, *t.shape[len(lead) + 1 :]).movedim(len(lead), 0)

    w = by_piece(weight).reshape(n, -1, k)
    b = None if bias is None else by_piece(bias.reshape(*lead, rows)).reshape(n, -1)
    xs = exact_copy(x.reshape(-1, k), n, group)
    y = _piecewise(xs, w, b)
    tokens = y.shape[1]
    return y.reshape(n, tokens, *lead, width).movedim(0, -2).reshape(*x.shape[:-1], -1)


def row_linear(x: torch.Tensor, weight: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """x [..., in/t], weight [out, in/t] (the inner dimension split over tp) -> y [..., out],
    replicated: n pieces of the inner dimension, each GEMM'd alone, summed by exact_reduce."""
    out, k = weight.shape
    width = k // n
    xs = x.reshape(-1, n, width).transpose(0, 1)
    ws = weight.reshape(out, n, width).transpose(0, 1)
    y = exact_reduce(_piecewise(xs, ws), group)
    return y.reshape(*x.shape[:-1], out)


def _piecewise(xs: torch.Tensor, ws: torch.Tensor, bs: torch.Tensor | None = None) -> torch.Tensor:
    """[n, m, k] x [n, out, k] (+ [n, out]) -> [n, m, out], one GEMM a piece on contiguous
    operands, each piece's gradient made contiguous before its bias's sum over m: a batched
    GEMM's kernel, and a column sum's order, may depend on the batch's size or the row stride,
    which the layout sets."""
    xs, ws = xs.contiguous(), ws.contiguous()
    pieces = []
    for j in range(xs.shape[0]):
        y = torch.mm(xs[j], ws[j].t())
        pieces.append(_ContiguousGrad.apply(y if bs is None else y + bs[j]))
    return torch.stack(pieces)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()

    @staticmethod
    def jvp(ctx, x_t):
        return x_t

    @staticmethod
    def vmap(info, in_dims, x):
        return _ContiguousGrad.apply(x), in_dims[0]
