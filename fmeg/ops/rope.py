"""Rotary position embedding, "rotate half" convention (Megatron's default, Hugging Face Llama)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, head_dim] in fp32 for integer positions.

    Positions are explicit so that a sequence shard (context parallelism) asks for its own offsets, and
    may be [batch, seq] when rows start at different positions (left-padded generation).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x [batch, heads, seq, head_dim] by the position's angles."""
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return (x_BNSD * cos_SD + rotated * sin_SD).to(x_BNSD.dtype)
