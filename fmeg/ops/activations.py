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


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), GELU's sigmoid approximation (GPT-OSS's gate)."""
    return x * torch.sigmoid(1.702 * x)


GATES = {"swiglu": F.silu, "quick_geglu": quick_gelu}


def mlp_activation(
    h: torch.Tensor, activation: str, glu_linear_offset: float = 0.0, clamp: float | None = None
) -> torch.Tensor:
    """The MLP's activation on fc1's output [..., F]; a gated one (swiglu, quick_geglu) takes [...,
    2F], gate then linear half, and gives gate_fn(gate) * (linear + glu_linear_offset), with the
    gate clamped above at clamp and the linear half to [-clamp, clamp] when clamp is given
    (GPT-OSS's, megatron-core's unfused GLU)."""
    if activation in GATES:
        gate, up = rearrange(h, "... (two f) -> two ... f", two=2)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        return GATES[activation](gate) * (up + glu_linear_offset)
    if activation == "gelu_tanh":
        return gelu_tanh(h)
    # Megatron's --squared-relu
    if activation == "squared_relu":
        return torch.relu(h).square()
    return gelu(h)
