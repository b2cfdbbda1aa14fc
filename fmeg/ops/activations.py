"""Pointwise MLP activations."""

from __future__ import annotations

import torch
from einops import rearrange
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU, x * Phi(x) (Megatron's default)."""
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's "gelu_new")."""
    return F.gelu(x, approximate="tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (Llama's gated MLP)."""
    return F.silu(gate) * up


def mlp_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP's activation on fc1's output [..., F] (swiglu: [..., 2F], gate then up, giving [..., F])."""
    if activation == "swiglu":
        gate, up = rearrange(h, "... (two f) -> two ... f", two=2)
        return swiglu(gate, up)
    if activation == "gelu_tanh":
        return gelu_tanh(h)
    if activation == "squared_relu":  # Megatron's --squared-relu
        return torch.relu(h).square()
    return gelu(h)
