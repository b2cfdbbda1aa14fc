"""Normalisation over the last (hidden) dimension, computed in at least fp32 whatever the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmeg.ops.precision import upcast


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias."""
    y = F.layer_norm(upcast(x), x.shape[-1:], None, None, eps)
    y = y * upcast(weight)
    if bias is not None:
        y = y + upcast(bias)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight (Llama's RMSNorm: the weight multiplies after the cast back)."""
    xa = upcast(x)
    y = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
