"""Causal self-attention over one device's heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q_BNSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) v, with grouped-query attention.

    q has N heads, k and v have G heads (G divides N); query head n reads kv head n // (N / G).
    Returns [batch, N, seq, head_dim]. Runs through scaled_dot_product_attention; its CPU flash
    kernel has no forward-mode AD, so run torch.func.jvp under
    torch.nn.attention.sdpa_kernel(SDPBackend.MATH).
    """
    n, g = q_BNSD.shape[1], k_BGSD.shape[1]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({g})")
    return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True, enable_gqa=g != n)
