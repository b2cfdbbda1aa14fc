"""FP8 for the experts' grouped GEMMs: each expert's rows (the tokens routed to it, sorted by
expert) times its weight, with the rows, the weight and the rows' output gradient quantized as
tensor-wise or delayed scaling say.

    y = fp8_grouped_linear(rows, weight, counts, expert_of_row, source_of_row, experts)

What a tensor is, per expert: one device running a microbatch quantizes expert e's input rows
with the amax of the rows that microbatch routed to e. Under expert parallelism an expert's rows
come from several microbatches (every data-parallel rank's), so each row is scaled by the amax of
its (expert, source microbatch) group, source_of_row naming the microbatch (the sending rank's
data-parallel index): each row gets the scale one device gives it, at any layout. The scales are
per row for the forward and input-gradient GEMMs (rowwise, as torch._scaled_mm takes them) and
run along the reduction dimension of the weight gradient, so every GEMM multiplies the dequantized
FP8 operands in fp32 (the same FP8 numbers; fmeg.ops.moe.grouped_matmul).

Delayed scaling keeps one row of its state per (layer, expert, fc1 | fc2), the amax recorded per
expert and reduced over every rank at the step's end as the dense linears' are. Block recipes
quantize rows in 1 x 128 (blockwise) or 1 x 32 (mxfp8) blocks along the reduction dimension and
each expert's weight in 128 x 128 tiles or 1 x 32 blocks; the weight gradient's blocks run along
the rows of one (expert, source) group, from its first row, so they are the ones one device forms
from its microbatch (fmeg.config.fp8_flags refuses layouts that would split such a group).

Sharding contract: each (expert, source) amax table is all-reduced (max) over amax_groups, the
ranks holding the same experts when a microbatch's rows for an expert reach more than one of
them (context parallelism, sequence-split tokens that are not exchanged), and over split_groups
(the experts' tensor parallelism) for the operands whose features it splits: the weight always,
fc2's input and fc1's output gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg.fp8.linear import BLOCK
from fmeg.fp8.quantize import amax_to_scale, dequantize, fp8_max, quantize_blocks, quantize_tiles
from fmeg.fp8.recipe import E4M3, Fp8Recipe
from fmeg.ops.moe import grouped_matmul, grouped_weight_grad
from fmeg.ops.weight_grads import defer

# the recipes whose experts run FP8 (TorchAO's rowwise, a research recipe, leaves them alone)
EXPERT_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


@dataclass(frozen=True)
class Fp8Experts:
    """One grouped linear's FP8 settings. sources: how many microbatch ids source_of_row takes
    (the data-parallel size); split_in / split_out: whether the experts' tp splits the input or
    the output features (fc2's input, fc1's output); delayed: (DelayedState, the state's row of
    each expert held here)."""

    recipe: Fp8Recipe
    sources: int = 1
    amax_groups: tuple[Any, ...] = ()
    split_groups: tuple[Any, ...] = ()
    split_in: bool = False
    split_out: bool = False
    delayed: tuple[Any, tuple[int, ...]] | None = None


def _all_max(t: torch.Tensor, groups: tuple[Any, ...]) -> torch.Tensor:
    for group in groups:
        if group is not None and group.size > 1:
            t = group.all_reduce(t, "max")
    return t


def _groups_amax(t: torch.Tensor, group_of_row: torch.Tensor, groups: int) -> torch.Tensor:
    """[groups + 1]: the amax of each group's rows (the last slot: rows of no expert here)."""
    rows = t.detach().abs().amax(dim=-1).float() if t.shape[-1] else t.new_zeros(t.shape[0])
    table = torch.zeros(groups + 1, device=t.device)
    return table.scatter_reduce(0, group_of_row, rows.float(), "amax", include_self=True)


def _row_scales(t, operand: int, rows: "_Rows", spec: Fp8Experts, split: bool, dtype):
    """Each row's scale [N] for operand (0: the input, 2: the output gradient)."""
    held = rows.held
    if spec.delayed is not None:
        state, state_rows = spec.delayed
        index = torch.tensor(state_rows, device=t.device, dtype=torch.long)
        state.record_rows(index, operand, _groups_amax(t, rows.expert, held)[:held])
        scales = torch.cat([state.scales_of(index, operand), t.new_ones(1, dtype=torch.float32)])
        return scales[rows.expert]
    groups = spec.amax_groups + (spec.split_groups if split else ())
    table = _all_max(_groups_amax(t, rows.group, held * spec.sources), groups)
    return amax_to_scale(table, dtype)[rows.group]


def _weight_scales(w: torch.Tensor, spec: Fp8Experts) -> torch.Tensor:
    """Each expert's weight scale [E]."""
    if spec.delayed is not None:
        state, state_rows = spec.delayed
        index = torch.tensor(state_rows, device=w.device, dtype=torch.long)
        if w.numel() and not state.weights_recorded.issuperset(state_rows):
            state.record_rows(index, 1, w.detach().abs().flatten(1).amax(dim=1).float())
        return state.scales_of(index, 1)
    amax = _all_max(w.detach().abs().flatten(1).amax(dim=1).float(), spec.split_groups)
    return amax_to_scale(amax, E4M3)


def _saturated(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return (t.float() * scale).clamp(-m, m).to(dtype)


@dataclass(frozen=True)
class _Rows:
    """Which expert (held: none here) and which (expert, source) group each row is in."""

    expert: torch.Tensor
    group: torch.Tensor
    held: int


def _rows(expert_of_row: torch.Tensor, source_of_row: torch.Tensor, held: int, sources: int):
    expert = expert_of_row.clamp(max=held).long()
    group = torch.where(expert < held, expert * sources + source_of_row.long(), held * sources)
    return _Rows(expert, group, held)


def _token_blocks(t: torch.Tensor, group: torch.Tensor, block: int, dtype) -> torch.Tensor:
    """t [N, C] dequantized from FP8 blocks of `block` consecutive rows of one group (an
    (expert, source) group, in row order) per column, with power-of-two scales: the weight
    gradient's operands, whose reduction runs over rows."""
    n, c = t.shape
    order = torch.argsort(group, stable=True)
    ranked = group[order]
    position = torch.empty_like(order)
    position[order] = torch.arange(n, device=t.device) - torch.searchsorted(ranked, ranked)
    blocks = n // block + 1
    index = (group * blocks + position // block)[:, None].expand(-1, c)
    table = torch.zeros(int(group.max()) * blocks + blocks if n else 0, c, device=t.device)
    table = table.scatter_reduce(0, index, t.detach().abs().float(), "amax", include_self=True)
    scale = amax_to_scale(table, dtype, power_of_two=True).gather(0, index)
    return _saturated(t, scale, dtype).float() / scale


def _weight_blocks(w: torch.Tensor, recipe: str, along_out: bool) -> torch.Tensor:
    """w [E, F, K] dequantized from FP8 as a block recipe quantizes it: 128 x 128 tiles
    (blockwise, both orientations) or 1 x 32 blocks along K (mxfp8; along F for the input
    gradient, along_out), per expert."""
    if recipe == "blockwise":
        return torch.stack([dequantize(quantize_tiles(m, E4M3, BLOCK[recipe])) for m in w])
    m = w.transpose(-1, -2) if along_out else w
    flat = dequantize(quantize_blocks(m.reshape(-1, m.shape[-1]), E4M3, BLOCK[recipe]))
    deq = flat.reshape(m.shape)
    return deq.transpose(-1, -2) if along_out else deq


def _row_blocks(t: torch.Tensor, dtype, recipe: str) -> torch.Tensor:
    return dequantize(quantize_blocks(t, dtype, BLOCK[recipe]))


class _Fp8Grouped(torch.autograd.Function):
    """rows [N, K], weight [E, F, K] (a gated [E, 2, F, K] read as [E, 2F, K]) -> [N, F]; the
    weight gradient may be deferred to a zero-bubble schedule's W (ops.weight_grads). Tensor-wise
    and delayed scaling keep the FP8 operands for backward; block recipes the inputs (the weight
    gradient's blocks run along the rows)."""

    @staticmethod
    def forward(rows, weight, counts, expert_of_row, source_of_row, spec):
        w = _flat(weight)
        r = spec.recipe.recipe
        if r in BLOCK:
            x_hat, w_hat = _row_blocks(rows, E4M3, r), _weight_blocks(w, r, False)
            y = grouped_matmul(x_hat, w_hat, counts)
            return y.to(rows.dtype), *(rows.new_empty(0),) * 4
        info = _rows(expert_of_row, source_of_row, w.shape[0], spec.sources)
        sx = _row_scales(rows, 0, info, spec, spec.split_in, E4M3)
        sw = _weight_scales(w, spec)
        qx, qw = _saturated(rows, sx[:, None], E4M3), _saturated(w, sw[:, None, None], E4M3)
        y = grouped_matmul(qx.float() / sx[:, None], qw.float() / sw[:, None, None], counts)
        return y.to(rows.dtype), qx, sx, qw, sw

    @staticmethod
    def setup_context(ctx, inputs, output):
        rows, weight, counts, expert_of_row, source_of_row, spec = inputs
        _, qx, sx, qw, sw = output
        ctx.mark_non_differentiable(qx, sx, qw, sw)
        needs_rows = not spec.recipe.wgrad or spec.recipe.recipe in BLOCK
        keep = rows if needs_rows else rows.new_empty(0)
        saved = (qx, sx, qw, sw, counts, expert_of_row, source_of_row, keep, weight)
        ctx.save_for_backward(*saved)
        ctx.spec, ctx.dtype = spec, rows.dtype

    @staticmethod
    def backward(ctx, gy, *_):
        qx, sx, qw, sw, counts, expert_of_row, source_of_row, rows, weight = ctx.saved_tensors
        spec: Fp8Experts = ctx.spec
        w = _flat(weight)
        info = _rows(expert_of_row, source_of_row, w.shape[0], spec.sources)
        r, gdt = spec.recipe.recipe, spec.recipe.grad_dtype
        if r in BLOCK:
            g_rows, w_in = _row_blocks(gy, gdt, r), _weight_blocks(w, r, True)
            operands = lambda: (  # noqa: E731
                _token_blocks(gy, info.group, BLOCK[r], gdt),
                _token_blocks(rows, info.group, BLOCK[r], E4M3),
            )
        else:
            sg = _row_scales(gy, 2, info, spec, spec.split_out, gdt)
            g_rows = _saturated(gy, sg[:, None], gdt).float() / sg[:, None]
            w_in = qw.float() / sw[:, None, None]
            operands = lambda: (g_rows, qx.float() / sx[:, None])  # noqa: E731
        dx = grouped_matmul(g_rows, w_in.transpose(-1, -2), counts).to(ctx.dtype)
        dw = None
        if ctx.needs_input_grad[1]:

            def compute() -> torch.Tensor:
                # --no-fp8-wgrad: the weight gradient from the unquantized operands
                a, b = operands() if spec.recipe.wgrad else (gy, rows)
                flat = (w.shape[0], a.shape[-1], b.shape[-1])
                grad = grouped_weight_grad(a.to(b.dtype), b, counts, flat)
                return grad.reshape(weight.shape).to(weight.dtype)

            deferred = not torch.compiler.is_compiling() and defer(weight, compute)
            dw = None if deferred else compute()
        return dx, dw, None, None, None, None


def _flat(weight: torch.Tensor) -> torch.Tensor:
    return weight.flatten(1, -2) if weight.dim() == 4 else weight


def fp8_grouped_linear(
    rows_NK: torch.Tensor,
    weight: torch.Tensor,
    counts_E: torch.Tensor,
    expert_of_row: torch.Tensor,
    source_of_row: torch.Tensor,
    spec: Fp8Experts,
) -> torch.Tensor:
    """fmeg.ops.moe.grouped_linear with FP8 operands: rows sorted by expert (expert_of_row: E' for
    rows of no expert held here, which give zeros), source_of_row: each row's microbatch id (in
    [0, spec.sources))."""
    y, *_ = _Fp8Grouped.apply(rows_NK, weight, counts_E, expert_of_row, source_of_row, spec)
    return y
