"""Attention with sinks and sliding windows, written out (GPT-OSS's attention: Megatron's
--softmax-type and --window-size).

    keep = visible(q_pos, k_pos, window=W, documents=cu_seqlens)      [b or 1, 1, sq, sk] booleans
    out = sink_attention(q, k, v, keep, sinks=s)
        q [b, N, sq, d]; k, v [b, G, sk, d]

Query i (at global position q_pos[i]) sees key j (at k_pos[j]) when k_pos[j] <= q_pos[i] and, with a
window W, k_pos[j] >= q_pos[i] - W: Megatron's window (W, 0), W + 1 keys (Hugging Face's
sliding_window counts them, W + 1). With packed documents (cu_seqlens [b, s + 1] on the host,
fmeg.ops.document_attention's) only keys of the query's own document. Positions are explicit so that
a context-parallel rank passes its own queries' and the whole sequence's keys.

A sink is one more logit per head in each row's softmax that adds nothing to the output: softmax
over [scores, sink] with the sink's column dropped (megatron-core's SoftmaxOne). Learnable sinks are
a parameter [N] (--softmax-type learnable); off-by-one is the logit 0 for every head. Either way a
row's probabilities sum to less than one, so a head can attend to nothing.

The scores [b, N, sq, sk] are materialised in fp32, as in the unfused softmax of Megatron's local
spec; they are plain differentiable ops, so every torch.func transform applies. drop (probs, q_pos,
k_pos) -> probs is attention dropout keyed by global positions
(fmeg.parallel.context_layout.AttentionDropout), or None.
"""

from __future__ import annotations

from typing import Callable

import torch

Drop = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each query sees: causal, within the window, within the query's document ([b or 1,
    1, sq, sk])."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep = keep & (k_pos[None, :] >= q_pos[:, None] - window)
    keep = keep[None, None]
    # the document of a position: how many boundaries lie at or before it
    if documents is not None:
        bounds = documents.to(q_pos.device)
        doc_q = torch.searchsorted(bounds, q_pos.expand(len(bounds), -1).contiguous(), right=True)
        doc_k = torch.searchsorted(bounds, k_pos.expand(len(bounds), -1).contiguous(), right=True)
        keep = keep & (doc_q[:, None, :, None] == doc_k[:, None, None, :])
    return keep


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    sinks: torch.Tensor | None = None,
    drop: Drop | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax([q k^T / sqrt(d) where keep, sinks]) without the sinks' column, times v; [b, N, sq,
    d]. Grouped-query attention: query head n reads key/value head n // (N / G). sinks: [N] logits
    (these heads'), or None. drop needs q_pos and k_pos (the global positions it keys on)."""
    n, g = q.shape[1], k.shape[1]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({g})")
    if g != n:
        k, v = (t.repeat_interleave(n // g, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32)) * q.shape[
        -1
    ] ** -0.5
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = probs.to(v.dtype)
    if drop is not None:
        probs = drop(probs, q_pos, k_pos)
    return probs @ v
