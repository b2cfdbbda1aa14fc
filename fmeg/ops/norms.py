"""Normalisation over the last (hidden) dimension, through torch's kernels (which accumulate in fp32
whatever the input dtype): one kernel each, with no upcast copies of the activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias."""
    return F.layer_norm(
        x, x.shape[-1:], weight.to(x.dtype), None if bias is None else bias.to(x.dtype), eps
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight (Llama's RMSNorm)."""
    return F.rms_norm(x, x.shape[-1:], weight.to(x.dtype), eps)
