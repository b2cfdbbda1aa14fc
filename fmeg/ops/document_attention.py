"""Causal attention within packed documents: each token sees the earlier tokens of its own document
only (Megatron's --reset-attention-mask; THD attention with cumulative sequence lengths,
megatron-core's PackedSeqParams).

    out = document_attention(q, k, v, cu_seqlens)
        q [b, N, s, d]; k, v [b, G, s, d] (G divides N)

cu_seqlens [b, s + 1] (integers, on the host) holds each row's document boundaries as cumulative
lengths, 0, end of the first document, ..., s, padded with s (zero-length documents are skipped, as
megatron-core pads cu_seqlens). No [s, s] mask is ever built: each document is its own causal
attention, so the result equals running each document alone.

Eagerly it is made of differentiable ops (scaled_dot_product_attention per document), so every
torch.func transform applies (jvp under SDPBackend.MATH, as for fmeg.ops.causal_attention). Under
torch.compile it is one opaque custom op each way (fmeg::document_attention and its backward) whose
documents run through the fused blocks of fmeg.ops.attention_blocks: the boundaries stay on the
host, out of the graph, and a new packing does not recompile.

With dropout_p > 0 and a key, each probability is dropped by its global (batch row, head, query,
key) position in the [b, total_heads, s, s] probabilities, the counters fmeg.ops.causal_attention
uses, so a tensor-parallel shard (head_offset) keeps one device's mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fmeg.ops import attention_blocks as blocks
from fmeg.ops.random import dropout as _dropout

Tensor = torch.Tensor


def document_spans(cu_seqlens: Tensor, seq: int) -> list[list[tuple[int, int]]]:
    """Each row's documents as (start, end), zero-length ones left out; ValueError unless every
    row's boundaries rise from 0 to seq."""
    if cu_seqlens.device.type != "cpu":
        raise ValueError(
            "cu_seqlens must stay on the host (reading it from a device would stall the step)"
        )
    spans = []
    for row in cu_seqlens.tolist():
        if row[0] != 0 or row[-1] != seq or any(b < a for a, b in zip(row, row[1:])):
            raise ValueError(
                f"cu_seqlens rows must rise from 0 to the sequence length {seq}, got {row}"
            )
        spans.append([(a, b) for a, b in zip(row, row[1:]) if b > a])
    return spans


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    dropout_p: float = 0.0,
    key: Any = None,
    head_offset: int = 0,
    total_heads: int | None = None,
) -> Tensor:
    """Causal attention within each row's documents (see the module docstring); [b, N, s, d]."""
    n, g = q.shape[1], k.shape[1]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of key/value heads ({g})")
    total = total_heads or n
    if dropout_p == 0.0:
        key = None
    if torch.compiler.is_compiling():
        return _document_op(q, k, v, cu_seqlens, dropout_p, key, head_offset, total)[0]
    spans = document_spans(cu_seqlens, q.shape[2])
    rows = []
    # split, not slices: the backward of a split is one cat, that of each slice a zero tensor of the
    # whole input
    for row, documents, *qkv in zip(range(len(spans)), spans, *(t.split(1) for t in (q, k, v))):
        parts = []
        pieces = (t.split([e - a for a, e in documents], dim=2) for t in qkv)
        for (a, e), qd, kd, vd in zip(documents, *pieces):
            if key is None:
                parts.append(
                    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=g != n)
                )
            else:
                pos = torch.arange(a, e, device=q.device)
                drop = _row_dropout(dropout_p, key, row, head_offset, total, q.shape[2])
                parts.append(blocks.block_forward(qd, kd, vd, True, drop, pos, pos)[0].to(q.dtype))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def _row_dropout(
    p: float, key: Any, row: int, head_offset: int, total_heads: int, seq: int
) -> blocks.Drop:
    """The blocks' dropout for batch row `row`: (probs [1, n, sq, sk], q_pos, k_pos) -> dropped,
    each probability counted by its place in the whole [b, total_heads, seq, seq]."""

    def drop(probs: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        heads = row * total_heads + head_offset + torch.arange(probs.shape[1], device=probs.device)
        index = (heads[:, None, None] * seq + q_pos[:, None]) * seq + k_pos
        return _dropout(probs, p, key, index=index[None])

    return drop


# ------------------------------------------------------------------------------------------------
# the twin torch.compile sees: one opaque op each way, each document a fused block


def _blocks(
    q: Tensor,
    cu_seqlens: Tensor,
    dropout_p: float,
    key: Tensor | None,
    head_offset: int,
    total_heads: int,
):
    """(row, rows' slice, positions, drop) of every document."""
    seq = q.shape[2]
    for row, documents in enumerate(document_spans(cu_seqlens, seq)):
        drop = (
            None
            if key is None
            else _row_dropout(dropout_p, key, row, head_offset, total_heads, seq)
        )
        for a, e in documents:
            yield row, slice(a, e), torch.arange(a, e, device=q.device), drop


@torch.library.custom_op("fmeg::document_attention", mutates_args=())
def _document_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    dropout_p: float,
    key: Tensor | None,
    head_offset: int,
    total_heads: int,
) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(q.shape[:3], dtype=blocks._accumulate(q))
    for row, span, pos, drop in _blocks(q, cu_seqlens, dropout_p, key, head_offset, total_heads):
        r = slice(row, row + 1)
        o, block_lse = blocks.block_forward(
            q[r, :, span].contiguous(),
            k[r, :, span].contiguous(),
            v[r, :, span].contiguous(),
            True,
            drop,
            pos,
            pos,
        )
        out[r, :, span], lse[r, :, span] = o.to(q.dtype), block_lse
    return out, lse


@_document_op.register_fake
def _(q, k, v, cu_seqlens, dropout_p, key, head_offset, total_heads):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=blocks._accumulate(q))


@torch.library.custom_op("fmeg::document_attention_backward", mutates_args=())
def _document_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    dropout_p: float,
    key: Tensor | None,
    head_offset: int,
    total_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    for row, span, pos, drop in _blocks(q, cu_seqlens, dropout_p, key, head_offset, total_heads):
        r = slice(row, row + 1)
        grads = blocks.block_backward(
            *(t[r, :, span].contiguous() for t in (dout, q, k, v, out)),
            lse[r, :, span].contiguous(),
            True,
            drop,
            pos,
            pos,
        )
        for full, part in zip((dq, dk, dv), grads):
            full[r, :, span] = part.to(full.dtype)
    return dq, dk, dv


@_document_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, dropout_p, key, head_offset, total_heads):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, dropout_p, key, head_offset, total_heads = inputs
    ctx.args = (dropout_p, head_offset, total_heads)
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, *([] if key is None else [key]))


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens, *key = ctx.saved_tensors
    dropout_p, head_offset, total_heads = ctx.args
    grads = _document_backward_op(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens,
        dropout_p,
        key[0] if key else None,
        head_offset,
        total_heads,
    )
    return *grads, None, None, None, None, None


_document_op.register_autograd(_backward, setup_context=_setup_context)
