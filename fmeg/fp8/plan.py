"""Which layers run FP8: Megatron's --first-last-layers-bf16 with --num-layers-at-start-in-bf16 and
--num-layers-at-end-in-bf16 (counted over the decoder's layers; the multi-token prediction layers
after them count as the end)."""

from __future__ import annotations

from dataclasses import dataclass

from fmeg.fp8.recipe import Fp8Recipe


@dataclass(frozen=True)
class Fp8Plan:
    recipe: Fp8Recipe
    num_layers: int
    bf16_at_start: int = 0
    bf16_at_end: int = 0

    def covers(self, index: int) -> bool:
        """Whether layer `index` (0-based; num_layers + k: the k-th MTP layer) runs FP8."""
        return self.bf16_at_start <= index < self.num_layers - self.bf16_at_end

    def label(self) -> str:
        fp8 = [i for i in range(self.num_layers) if self.covers(i)]
        where = (
            "no layer"
            if not fp8
            else f"layers {fp8[0]}-{fp8[-1]}"
            if len(fp8) > 1
            else f"layer {fp8[0]}"
        )
        return (
            f"FP8 {self.recipe.label} in {where} of {self.num_layers}: their qkv, projection and "
            "MLP GEMMs (embedding, output layer, router, experts, attention and norms in the "
            "compute dtype)"
        )


def fp8_start_line(plan: Fp8Plan, device, sharding: str | None) -> str:
    """The start line's FP8 sentence: the plan, and where the GEMMs run (torch._scaled_mm serves
    one scale per tensor; block recipes dequantize to fp32 and multiply, the same FP8 numbers)."""
    where = (
        "torch._scaled_mm"
        if plan.recipe.recipe == "tensorwise"
        else "dequantized FP8 operands multiplied in fp32 (no _scaled_mm kernel for its scales "
        "here)"
    )
    gathered = (
        "; weights gathered in the compute dtype (FP8 gathers not yet: the same numbers)"
        if sharding != "no_shard"
        else ""
    )
    return f"{plan.label()}; GEMMs on {device} through {where}{gathered}"
