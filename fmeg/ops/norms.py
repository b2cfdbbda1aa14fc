"""Normalisation over the last (hidden) dimension, through torch's kernels (which accumulate in fp32
whatever the input dtype): one kernel each, with no upcast copies of the activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias (None: no scale, no shift)."""
    return F.layer_norm(x, x.shape[-1:], _cast(weight, x), _cast(bias, x), eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight (Llama's RMSNorm; None: no scale)."""
    return F.rms_norm(x, x.shape[-1:], _cast(weight, x), eps)


def _cast(p: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return None if p is None else p.to(x.dtype)
