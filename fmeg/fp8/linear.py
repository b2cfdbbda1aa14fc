"""An FP8 linear layer: y = x @ w.T + b with x, w and the output gradient quantized as the recipe
says, each of its three GEMMs (forward, input gradient, weight gradient) on FP8 operands.

    y = fp8_linear(x, w, b, Fp8Gemms(Fp8Recipe("hybrid", "tensorwise"), w_groups=(tp,)))

Each GEMM is A @ B.T with both operands quantized along the reduction dimension:

    forward   x [M, K] . w [N, K]      (K: input features)
    dgrad     g [M, N] . w.T [K, N]    (N: output features; g in e5m2 under hybrid)
    wgrad     g.T [N, M] . x.T [K, M]  (M: tokens)

Tensor-wise operands are quantized once (the transpose of a tensor-wise FP8 tensor is one); block
recipes quantize each orientation along its own reduction dimension (128 x 128 weight tiles serve
both). A GEMM whose scales torch._scaled_mm takes (one per tensor: on CPU and CUDA; e5m2 x e5m2 and
CUDA shapes that are not multiples of 16 excepted) runs there with fp32 accumulation; every other
dequantizes its operands to fp32 and multiplies: the same FP8 numbers, fp32 arithmetic.

Delayed scaling (fmeg.fp8.delayed) quantizes x, w and g tensor-wise with the scales its state
holds from earlier iterations and records each operand's local amax there; the state's step-end
reduction over every rank makes them the whole tensors' amaxes.

Sharding contract: under tensor-wise scaling each operand's amax is all-reduced (max) over the
groups named for it in Fp8Gemms: the ranks that hold other parts of the same tensor (tp for a
sharded weight or feature dimension, cp for a split sequence), so every rank quantizes with the
scale one device computes for the whole tensor. Block recipes need no reduction: their blocks lie
inside one rank's part, which fmeg.fp8.check_blocks verifies of the layout. The bias is added in
the input's precision, after the GEMM (Transformer Engine's order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg.ops.weight_grads import defer

from fmeg.fp8.quantize import (
    Quantized,
    dequantize,
    quantize_blocks,
    quantize_tensorwise,
    quantize_tiles,
    quantize_with_scale,
    tensor_amax,
)
from fmeg.fp8.recipe import E4M3, E5M2, Fp8Recipe

BLOCK = {"blockwise": 128, "mxfp8": 32}


@dataclass(frozen=True)
class Fp8Gemms:
    """One linear layer's FP8 settings: the recipe, and for tensor-wise scaling the groups each
    operand's amax is reduced over (x: the input, w: the weight, g: the output gradient)."""

    recipe: Fp8Recipe
    x_groups: tuple[Any, ...] = ()
    w_groups: tuple[Any, ...] = ()
    g_groups: tuple[Any, ...] = ()
    # delayed scaling: (the fmeg.fp8.delayed.DelayedState, this linear's row of it)
    delayed: tuple[Any, int] | None = None


def _reduced_amax(t: torch.Tensor, groups: tuple[Any, ...]) -> torch.Tensor:
    amax = tensor_amax(t)
    for group in groups:
        if group is not None and group.size > 1:
            amax = group.all_reduce(amax, "max")
    return amax


def quantize(t: torch.Tensor, dtype: torch.dtype, recipe: str, weight: bool) -> Quantized:
    """t [rows, K] quantized along K for a block recipe (weights of blockwise: 128 x 128 tiles)."""
    if recipe == "rowwise":
        return quantize_blocks(t, dtype, t.shape[-1])
    if recipe == "blockwise" and weight:
        return quantize_tiles(t, dtype, BLOCK[recipe])
    return quantize_blocks(t, dtype, BLOCK[recipe])


def transpose(q: Quantized) -> Quantized:
    """The transpose of a tensor-wise or tiled operand (its blocks are squares)."""
    return Quantized(q.data.t(), q.scale if q.tile is None else q.scale.t(), tile=q.tile)


def _scaled_mm_serves(a: Quantized, b: Quantized) -> bool:
    """Whether torch._scaled_mm takes these operands: one scale each (a tensor's)."""
    if a.scale.dim() or b.scale.dim() or a.block or b.block or a.tile or b.tile:
        return False
    if a.data.dtype == E5M2 and b.data.dtype == E5M2:
        return False
    if a.data.is_cuda:
        return a.data.shape[-1] % 16 == 0 and b.data.shape[0] % 16 == 0
    return True


def gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K].T from FP8 operands, in out_dtype."""
    if _scaled_mm_serves(a, b):
        mm_dtype = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
        y = torch._scaled_mm(
            a.data.contiguous(),
            b.data.contiguous().t(),
            scale_a=a.scale.reciprocal(),
            scale_b=b.scale.reciprocal(),
            out_dtype=mm_dtype,
        )
        return y.to(out_dtype)
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)


def _delayed(t: torch.Tensor, gemms: Fp8Gemms, operand: int, dtype: torch.dtype) -> Quantized:
    """t quantized with the state's scale for this operand (from earlier iterations), its amax
    recorded for the next."""
    state, row = gemms.delayed
    if operand != 1 or row not in state.weights_recorded:
        state.record(row, operand, tensor_amax(t))
    return quantize_with_scale(t, state.scale_of(row, operand), dtype)


def _forward_operands(x, w, gemms: Fp8Gemms) -> tuple[Quantized, Quantized]:
    r = gemms.recipe.recipe
    if r == "delayed":
        return _delayed(x, gemms, 0, E4M3), _delayed(w, gemms, 1, E4M3)
    if r == "tensorwise":
        return (
            quantize_tensorwise(x, E4M3, _reduced_amax(x, gemms.x_groups)),
            quantize_tensorwise(w, E4M3, _reduced_amax(w, gemms.w_groups)),
        )
    return quantize(x, E4M3, r, False), quantize(w, E4M3, r, True)


class _Fp8Linear(torch.autograd.Function):
    """x [M, K], weight [N, K] or a stack [..., N_last, K] read as [N, K] -> (y [M, N], x's scale,
    w's scale); the scales are constants. The weight gradient may be deferred to a zero-bubble
    schedule's W (ops.weight_grads), computed from what B quantized."""

    @staticmethod
    def forward(x, weight, gemms):
        qx, qw = _forward_operands(x, _matrix(weight), gemms)
        return gemm(qx, qw, x.dtype), qx.scale, qw.scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, gemms = inputs
        _, sx, sw = output
        ctx.mark_non_differentiable(sx, sw)
        ctx.save_for_backward(x, weight, sx, sw)
        ctx.gemms = gemms

    @staticmethod
    def backward(ctx, gy, _sx, _sw):
        x, weight, sx, sw = ctx.saved_tensors
        w = _matrix(weight)
        gemms: Fp8Gemms = ctx.gemms
        r, gdt = gemms.recipe.recipe, gemms.recipe.grad_dtype
        dx = dw = None
        if r in ("tensorwise", "delayed"):
            # the gradient's scale (its amax reduced over the ranks) is taken in B
            qg = (
                _delayed(gy, gemms, 2, gdt)
                if r == "delayed"
                else quantize_tensorwise(gy, gdt, _reduced_amax(gy, gemms.g_groups))
            )
            qx, qw = (quantize_with_scale(t, s, E4M3) for t, s in ((x, sx), (w, sw)))
            if ctx.needs_input_grad[0]:
                dx = gemm(qg, transpose(qw), x.dtype)

            def compute() -> torch.Tensor:
                # --no-fp8-wgrad: the weight gradient in the compute dtype
                if not gemms.recipe.wgrad:
                    return (gy.t() @ x).to(w.dtype)
                return gemm(transpose(qg), transpose(qx), w.dtype)

        else:
            if ctx.needs_input_grad[0]:
                # square tiles serve both orientations; 1 x n blocks run along the other dimension
                qw_t = (
                    transpose(quantize(w, E4M3, r, True))
                    if r == "blockwise"
                    else quantize(w.t(), E4M3, r, True)
                )
                dx = gemm(quantize(gy, gdt, r, False), qw_t, x.dtype)

            def compute() -> torch.Tensor:
                qg_t = quantize(gy.t(), gdt, r, False)
                return gemm(qg_t, quantize(x.t(), E4M3, r, False), w.dtype)

        if ctx.needs_input_grad[1]:
            deferred = not torch.compiler.is_compiling() and defer(
                weight, lambda: compute().reshape(weight.shape)
            )
            dw = None if deferred else compute().reshape(weight.shape)
        return dx, dw, None


def _matrix(weight: torch.Tensor) -> torch.Tensor:
    return weight.flatten(0, -2) if weight.dim() > 2 else weight


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemms: Fp8Gemms
) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) with FP8 GEMMs; weight [N, K] or a stack [..., N_last, K]
    flattened to [N, K] as fmeg.ops.linear reads it."""
    if weight.dim() > 2:
        bias = None if bias is None else bias.flatten()
    y, _, _ = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, gemms)
    y = y.reshape(*x.shape[:-1], _matrix(weight).shape[0])
    return y if bias is None else y + bias
