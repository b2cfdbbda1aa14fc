"""The accumulation dtype of reductions: at least fp32, and fp64 stays fp64."""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in promote(x.dtype, fp32): bf16/fp16 -> fp32, fp32 and fp64 unchanged (no copy)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
