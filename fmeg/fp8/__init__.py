"""FP8 training: recipes (fmeg.fp8.recipe), quantization as pure functions (fmeg.fp8.quantize) and
the FP8 linear layer the tensor-parallel linears switch to (fmeg.fp8.linear), and the experts'
grouped GEMMs in FP8 (fmeg.fp8.grouped)."""

from fmeg.fp8.grouped import Fp8Experts, fp8_grouped_linear
from fmeg.fp8.linear import Fp8Gemms, fp8_linear
from fmeg.fp8.recipe import E4M3, E5M2, Fp8Recipe

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8Experts",
    "Fp8Gemms",
    "Fp8Recipe",
    "fp8_grouped_linear",
    "fp8_linear",
]
