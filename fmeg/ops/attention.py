"""Causal self-attention over one device's heads."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fmeg.ops.random import dropout


def causal_attention(
    q_BNSD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    key: Any = None,
    head_offset: int = 0,
    total_heads: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) v, with grouped-query attention.

    q has N heads, k and v have G heads (G divides N); query head n reads kv head n // (N / G).
    Returns [batch, N, seq, head_dim]. Runs through scaled_dot_product_attention; its CPU flash
    kernel has no forward-mode AD, so run torch.func.jvp under
    torch.nn.attention.sdpa_kernel(SDPBackend.MATH).

    With dropout_p > 0 and a key, the attention probabilities are dropped (Megatron's attention
    dropout) by a counter-based mask keyed by each probability's global position (batch row, head,
    query, key): these N heads are heads head_offset .. head_offset + N - 1 of total_heads (a
    tensor-parallel shard passes its offset), so the mask does not depend on how heads are split.
    That path computes the [b, N, s, s] probabilities explicitly.
    """
    n, g = q_BNSD.shape[1], k_BGSD.shape[1]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({g})")
    # a branch, not enable_gqa=g != n: under dynamic shapes that is a SymBool
    if dropout_p == 0.0 or key is None:
        if g == n:
            return F.scaled_dot_product_attention(q_BNSD, k_BGSD, v_BGSD, is_causal=True)
        return F.scaled_dot_product_attention(
            q_BNSD, k_BGSD, v_BGSD, is_causal=True, enable_gqa=True
        )
    b, _, s, d = q_BNSD.shape
    k, v = (t.repeat_interleave(n // g, dim=1) for t in (k_BGSD, v_BGSD))
    scores = (q_BNSD @ k.transpose(-1, -2)).to(
        torch.promote_types(q_BNSD.dtype, torch.float32)
    ) * d**-0.5
    causal = torch.ones(s, s, dtype=torch.bool, device=q_BNSD.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).to(q_BNSD.dtype)
    return (
        dropout(
            probs,
            dropout_p,
            key,
            index=_probability_index(b, n, s, head_offset, total_heads or n, q_BNSD.device),
        )
        @ v
    )


def _probability_index(
    b: int, n: int, s: int, head_offset: int, total_heads: int, device: Any
) -> torch.Tensor:
    """The flat position of each [b, n, s, s] probability in the unsharded [b, total_heads, s, s]
    tensor."""
    ar = torch.arange
    rows = ar(b, device=device)[:, None] * total_heads + head_offset + ar(n, device=device)
    return (rows[:, :, None, None] * s + ar(s, device=device)[:, None]) * s + ar(s, device=device)
