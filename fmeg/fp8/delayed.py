"""Delayed scaling: Transformer Engine's DelayedScaling, Megatron's default --fp8-recipe. Each GEMM
operand (x, w and the output gradient g of every FP8 linear) is quantized with a scale computed
from the amaxes of earlier iterations, kept in an amax history that is part of the training state.

    state = DelayedState(num_layers, history_len, device)
    ... each FP8 GEMM reads state.scale[row] and records its operands' amaxes in state.history[0]
    finish_step(state, recipe, groups)        # once per iteration: reduce, roll, new scales

The update is TE's (transformer_engine/pytorch/fp8.py): amax = the history's max (--fp8-amax-
compute-algo max) or its row 0 (most_recent); the history rolls one place and row 0 starts again
at 0; scale = fp8_max / amax / 2^margin, kept where amax is 0 or not finite. Scales start at 1.

fmeg's step: the history rolls once per iteration, and each operand's amax is the max over the
iteration's microbatches and over every rank (tp and cp ranks hold parts of the tensor, data and
pipeline ranks other microbatches and layers), so the scales, and the curve, are one device's at
any layout. TE rolls at each fp8_autocast exit, which Megatron opens per microbatch, and reduces
over dp x tp x cp: the same numbers when each rank runs one microbatch per iteration.
"""

from __future__ import annotations

import torch

from fmeg.fp8.recipe import E4M3, Fp8Recipe

# the FP8 linears of a layer, each a row of the state (a layer uses those it has)
SITES = ("qkv", "proj", "fc1", "fc2", "q_up", "kv_up")
# each expert's grouped linears: rows after every layer's SITES, per (layer, expert)
EXPERT_SITES = ("fc1", "fc2")
OPERANDS = ("x", "w", "g")


class DelayedState:
    """history [history_len, sites, 3] and scale [sites, 3] (fp32; x, w, g per site), alike on
    every rank; sites: every layer's SITES, then each layer's experts' EXPERT_SITES (num_experts:
    the experts of a layer with experts, 0 for none). Compared and hashed by identity: the layer
    functions that read it are cached by their settings."""

    def __init__(
        self,
        num_layers: int,
        history_len: int,
        device=None,
        grad_factor: int = 1,
        num_experts: int = 0,
    ):
        self.num_layers, self.num_experts = num_layers, num_experts
        sites = num_layers * (len(SITES) + num_experts * len(EXPERT_SITES))
        self.history = torch.zeros(history_len, sites, len(OPERANDS), device=device)
        self.scale = torch.ones(sites, len(OPERANDS), device=device)
        # the runner seeds each microbatch's backward with 1 / its rank's microbatches, so the
        # gradients inside the backward are dp times one device's: g's amax is recorded, and its
        # scale applied, in one device's units (exactly, for dp a power of two)
        self.grad_factor = grad_factor
        # rows whose weight amax --fp8-param-gather records from the owned chunks (their
        # linears' forward does not: it sees the dequantized weight)
        self.weights_recorded: frozenset[int] = frozenset()

    def row(self, layer: int, site: str) -> int:
        return layer * len(SITES) + SITES.index(site)

    def expert_row(self, layer: int, expert: int, site: str) -> int:
        dense = self.num_layers * len(SITES)
        return (
            dense
            + (layer * self.num_experts + expert) * len(EXPERT_SITES)
            + (EXPERT_SITES.index(site))
        )

    def record(self, row: int, operand: int, amax: torch.Tensor) -> None:
        """Row 0 of the history takes the max of what it holds and amax. Written through .data:
        the linear's backward records g's amax inside torch.func transforms too, where the state is
        a captured tensor (its value is a constant: no gradient flows through an amax)."""
        slot = self.history.data[0, row, operand]
        amax = amax.detach().to(slot.dtype) / (self.grad_factor if operand == 2 else 1)
        slot.copy_(torch.maximum(slot, amax))

    def record_rows(self, rows: torch.Tensor, operand: int, amax: torch.Tensor) -> None:
        """record for several rows at once (an amax [len(rows)] each: the experts')."""
        amax = amax.detach().to(self.history.dtype) / (self.grad_factor if operand == 2 else 1)
        slots = self.history.data[0, :, operand]
        slots.scatter_reduce_(0, rows, amax, "amax")

    def scales_of(self, rows: torch.Tensor, operand: int) -> torch.Tensor:
        """scale_of for several rows at once."""
        scale = self.scale[rows, operand]
        return scale / self.grad_factor if operand == 2 else scale

    def scale_of(self, row: int, operand: int) -> torch.Tensor:
        """The scale this layout applies (g's: one device's over grad_factor)."""
        scale = self.scale[row, operand].clone()
        return scale / self.grad_factor if operand == 2 else scale


def updated(
    history: torch.Tensor, scale: torch.Tensor, recipe: Fp8Recipe, fp8_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rolled history, the new scales) from the history whose row 0 holds this iteration's
    amaxes: TE's _default_get_amax_and_update_history and _default_sf_compute. fp8_max: [3], each
    operand's format's largest value."""
    amax = history.amax(dim=0) if recipe.algo == "max" else history[0]
    rolled = torch.roll(history, -1, 0) if history.shape[0] > 1 else history.clone()
    rolled[0] = 0.0
    fresh = fp8_max / amax / 2.0**recipe.margin
    fresh = torch.where((amax > 0) & amax.isfinite(), fresh, scale)
    return rolled, fresh


def finish_step(state: DelayedState, recipe: Fp8Recipe, groups) -> None:
    """This iteration's amaxes reduced (max) over groups (together: every rank), the history rolled
    and the scales renewed, in place (the layers hold these tensors)."""
    current = state.history[0]
    for group in groups:
        if group is not None and group.size > 1:
            current.copy_(group.all_reduce(current.contiguous(), "max"))
    maxes = [torch.finfo(E4M3).max, torch.finfo(E4M3).max, torch.finfo(recipe.grad_dtype).max]
    fp8_max = torch.tensor(maxes, device=current.device)
    history, scale = updated(state.history, state.scale, recipe, fp8_max)
    state.history.copy_(history)
    state.scale.copy_(scale)
