"""An FP8 recipe: Megatron-LM's --fp8-format and --fp8-recipe as one value.

    Fp8Recipe("hybrid", "tensorwise")   # e4m3 forward, e5m2 gradients, one scale per tensor
    Fp8Recipe("e4m3", "blockwise")      # DeepSeek-V3's 1 x 128 activation, 128 x 128 weight tiles
    Fp8Recipe("hybrid", "mxfp8")        # 1 x 32 blocks with power-of-two (e8m0) scales
    Fp8Recipe("e4m3", "rowwise")        # TorchAO's rowwise recipe (not a Megatron choice)

Formats are Transformer Engine's (megatron/core/fp8_utils.py hands --fp8-format to every recipe):
e4m3 quantizes every operand to float8_e4m3fn; hybrid quantizes the output gradient to
float8_e5m2 (wider range, less precision) and everything else to e4m3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FORMATS = ("e4m3", "hybrid")
# Megatron's --fp8-recipe choices fmeg computes (custom needs Transformer Engine)
RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")
# rowwise: TorchAO's, for research and its oracle; no Megatron flag names it
ALL_RECIPES = RECIPES + ("rowwise",)


@dataclass(frozen=True)
class Fp8Recipe:
    format: str = "hybrid"
    recipe: str = "tensorwise"
    # delayed scaling's (Megatron applies them to no other recipe): its amax window and choice,
    # the scale's 2^-margin, and whether the weight gradient's GEMM is FP8 (--no-fp8-wgrad)
    history_len: int = 1
    algo: str = "most_recent"
    margin: int = 0
    wgrad: bool = True

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format {self.format!r}: expected one of {FORMATS}")
        if self.recipe not in ALL_RECIPES:
            raise ValueError(f"FP8 recipe {self.recipe!r}: expected one of {ALL_RECIPES}")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's FP8 dtype (TorchAO's rowwise recipe keeps e4m3 for all)."""
        return E5M2 if self.format == "hybrid" and self.recipe != "rowwise" else E4M3

    @property
    def label(self) -> str:
        """The start line's words for it."""
        grads = "e5m2" if self.grad_dtype == E5M2 else "e4m3"
        scales = {
            "tensorwise": "one scale per tensor",
            "delayed": f"one scale per tensor from an amax history of {self.history_len} "
            f"iterations ({self.algo}, margin {self.margin})"
            + ("" if self.wgrad else "; weight gradients in the compute dtype"),
            "rowwise": "one power-of-two scale per row",
            "blockwise": "1x128 activation and 128x128 weight blocks, power-of-two scales",
            "mxfp8": "1x32 blocks, e8m0 scales",
        }[self.recipe]
        return f"{self.recipe} ({self.format}: e4m3 forward, {grads} gradients; {scales})"
