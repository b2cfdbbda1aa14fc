"""Rotary position embedding, "rotate half" convention (Megatron's default, Hugging Face Llama)."""

from __future__ import annotations

import math

import torch


def llama3_scaled(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_positions: int,
) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling (HF rope_type "llama3", Megatron's --use-rope-scaling):
    wavelengths longer than original / low_freq_factor are stretched by factor, those shorter than
    original / high_freq_factor kept, and the band between blended smoothly."""
    wavelength = 2 * math.pi / inv_freq
    low, high = original_max_positions / low_freq_factor, original_max_positions / high_freq_factor
    scaled = torch.where(wavelength > low, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high) & (wavelength <= low)
    return torch.where(medium, blended, scaled)


def yarn_scaled(
    inv_freq: torch.Tensor,
    theta: float,
    factor: float,
    original_max_positions: int,
    beta_fast: float,
    beta_slow: float,
    round_to_int: bool = True,
) -> torch.Tensor:
    """YaRN's frequencies (DeepSeek's, megatron-core's YarnRotaryEmbedding): the dimensions that
    turn fewer than beta_slow times over the original context are interpolated (divided by factor),
    those that turn more than beta_fast times kept, and a linear ramp between them, over whole
    dimensions when round_to_int (DeepSeek's; GPT-OSS's ramp starts and ends between dimensions:
    Hugging Face's truncate=False)."""
    dim = 2 * inv_freq.numel()

    # the dimension whose frequency turns `turns` times
    def dimension_of(turns: float) -> float:
        return (
            dim * math.log(original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
        / (high - low if high != low else 0.001)
    ).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    scaling: tuple[float, float, float, int] | None = None,
    yarn: tuple[float, int, float, float, float, float, bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, head_dim] in fp32 for integer positions; scaling: Llama
    3.1's (factor, low_freq_factor, high_freq_factor, original_max_positions), or None; yarn: YaRN's
    (factor, original_max_positions, beta_fast, beta_slow, mscale, mscale_all_dim, round_to_int),
    its tables scaled by yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim), or None.

    Positions are explicit so that a sequence shard (context parallelism) asks for its own offsets,
    and may be [batch, seq] when rows start at different positions (left-padded generation).
    """
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    exponent = (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    )
    inv_freq = 1.0 / (theta**exponent)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, *scaling)
    concentration = 1.0
    if yarn is not None:
        factor, original, beta_fast, beta_slow, mscale, mscale_all_dim, round_to_int = yarn
        inv_freq = yarn_scaled(
            inv_freq, theta, factor, original, beta_fast, beta_slow, round_to_int
        )
        concentration = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    freqs = positions.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    if concentration == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * concentration, angles.sin() * concentration


def apply_rope(x_BNSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of x [batch, heads, seq, head_dim] by the position's angles."""
    half = x_BNSD.shape[-1] // 2
    rotated = torch.cat([-x_BNSD[..., half:], x_BNSD[..., :half]], dim=-1)
    return (x_BNSD * cos_SD + rotated * sin_SD).to(x_BNSD.dtype)
