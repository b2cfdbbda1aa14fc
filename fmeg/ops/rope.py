"""Rotary position embedding, "rotate half" convention (Megatron's default, Hugging Face Llama)."""

from __future__ import annotations

import math

import torch


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_positions: int) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling (HF rope_type "llama3", Megatron's --use-rope-scaling): wavelengths
    longer than original / low_freq_factor are stretched by factor, those shorter than original /
    high_freq_factor kept, and the band between blended smoothly."""
    wavelength = 2 * math.pi / inv_freq
    low, high = original_max_positions / low_freq_factor, original_max_positions / high_freq_factor
    scaled = torch.where(wavelength > low, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high) & (wavelength <= low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, head_dim] in fp32 for integer positions; scaling: Llama 3.1's
    (factor, low_freq_factor, high_freq_factor, original_max_positions), or None.

    Positions are explicit so that a sequence shard (context parallelism) asks for its own offsets, and
    may be [batch, seq] when rows start at different positions (left-padded generation).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, *scaling)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x [batch, heads, seq, head_dim] by the position's angles."""
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return (x_BNSD * cos_SD + rotated * sin_SD).to(x_BNSD.dtype)
