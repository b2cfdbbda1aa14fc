"""Which layers run FP8: Megatron's --first-last-layers-bf16 with --num-layers-at-start-in-bf16 and
--num-layers-at-end-in-bf16 (counted over the decoder's layers; the multi-token prediction layers
after them count as the end)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fmeg.fp8.grouped import EXPERT_RECIPES, Fp8Experts
from fmeg.fp8.linear import Fp8Gemms
from fmeg.fp8.recipe import Fp8Recipe


@dataclass(frozen=True)
class Fp8Layer:
    """What one layer's linears run with: the recipe, and under delayed scaling the run's
    DelayedState and the layer's index in it."""

    recipe: Fp8Recipe
    state: Any = None
    index: int = 0

    def gemms(self, site: str, x_groups=(), w_groups=(), g_groups=()) -> Fp8Gemms:
        """The Fp8Gemms of the layer's linear `site` (fmeg.fp8.delayed.SITES)."""
        delayed = (self.state, self.state.row(self.index, site)) if self.state else None
        return Fp8Gemms(self.recipe, x_groups, w_groups, g_groups, delayed)

    def experts(
        self, site: str, first: int, held: int, sources: int, amax_groups=(), split_groups=()
    ) -> Fp8Experts | None:
        """The Fp8Experts of the layer's experts' grouped linear `site` (fc1 or fc2) for the held
        experts numbered from first, or None where the recipe keeps experts in the compute dtype."""
        if self.recipe.recipe not in EXPERT_RECIPES:
            return None
        delayed = (
            (
                self.state,
                tuple(self.state.expert_row(self.index, first + e, site) for e in range(held)),
            )
            if self.state
            else None
        )
        return Fp8Experts(
            self.recipe,
            sources,
            tuple(amax_groups),
            tuple(split_groups),
            split_in=site == "fc2",
            split_out=site == "fc1",
            delayed=delayed,
        )


@dataclass(frozen=True)
class Fp8Plan:
    recipe: Fp8Recipe
    num_layers: int
    bf16_at_start: int = 0
    bf16_at_end: int = 0
    # delayed scaling's fmeg.fp8.delayed.DelayedState (the runner's), or None
    state: Any = None
    # --fp8-param-gather: the distributed optimizer gathers the FP8 linears' weights as FP8 bytes
    param_gather: bool = False

    def covers(self, index: int) -> bool:
        """Whether layer `index` (0-based; num_layers + k: the k-th multi-token prediction layer,
        which follows the decoder's last) runs FP8."""
        if index >= self.num_layers:
            return self.bf16_at_end == 0
        return self.bf16_at_start <= index < self.num_layers - self.bf16_at_end

    @property
    def uniform(self) -> bool:
        """Every layer runs alike: all in FP8, with no per-layer state (delayed scaling's rows)."""
        return self.bf16_at_start == self.bf16_at_end == 0 and self.state is None

    def layer(self, index: int) -> Fp8Layer | None:
        """Layer index's FP8 settings, or None where it runs in the compute dtype."""
        return (
            Fp8Layer(self.recipe, self.state, index if self.state else 0)
            if self.covers(index)
            else None
        )

    def label(self) -> str:
        fp8 = [i for i in range(self.num_layers) if self.covers(i)]
        where = (
            "no layer"
            if not fp8
            else f"layers {fp8[0]}-{fp8[-1]}"
            if len(fp8) > 1
            else f"layer {fp8[0]}"
        )
        experts = self.recipe.recipe in EXPERT_RECIPES
        return (
            f"FP8 {self.recipe.label} in {where} of {self.num_layers}: their qkv, projection and "
            + ("MLP GEMMs and the experts' grouped GEMMs " if experts else "MLP GEMMs ")
            + "(embedding, output layer, router, "
            + ("" if experts else "experts, ")
            + "attention and norms in the compute dtype)"
        )


def fp8_start_line(plan: Fp8Plan, device, sharding: str | None, eager: bool = False) -> str:
    """The start line's FP8 sentence: the plan, and where the GEMMs run (torch._scaled_mm serves
    one scale per tensor; block recipes dequantize to fp32 and multiply, the same FP8 numbers);
    eager: compilation was asked for but the stages run eagerly (delayed scaling's state)."""
    where = (
        "torch._scaled_mm"
        if plan.recipe.recipe in ("tensorwise", "delayed")
        else "dequantized FP8 operands multiplied in fp32 (no _scaled_mm kernel for its scales "
        "here)"
    )
    gathered = ""
    if plan.param_gather:
        gathered = {
            "optim": "; the distributed optimizer all-gathers the FP8 weights as FP8 bytes",
            "optim_grads": "; the distributed optimizer all-gathers the FP8 weights as FP8 bytes",
            "optim_grads_params": "; Megatron-FSDP all-gathers the FP8 weights as FP8 bytes",
        }.get(sharding, "; --fp8-param-gather: no weights are gathered at this layout")
    uncompiled = (
        "; the stages run eagerly: delayed scaling compiles only with one graph per stage and pp 1"
        if eager
        else ""
    )
    experts = (
        ", the experts' as dequantized FP8 operands multiplied in fp32"
        if plan.recipe.recipe in EXPERT_RECIPES
        else ""
    )
    return f"{plan.label()}; GEMMs on {device} through {where}{experts}{gathered}{uncompiled}"
