"""Where a context-parallel rank's tokens sit in the sequence, and attention dropout keyed by global
position.

The sequence is cut into 2 x cp chunks of c = s / (2 cp) tokens; rank r holds chunks r and 2cp - 1 -
r (Megatron's get_batch_on_this_cp_rank), so every rank does the same share of the causal work.
These helpers are the layout's arithmetic, shared by every comm type (fmeg.parallel.context,
fmeg.parallel.ring_attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg import ops

# the sequence dimension of [b, heads, s, d]
SEQ = 2


@dataclass(frozen=True)
class AttentionDropout:
    """Attention dropout keyed as one device's (fmeg.ops.attention): each probability by its global
    (batch row, head, query, key) position; these heads are heads head_offset ... of total_heads."""

    p: float
    key: Any
    head_offset: int = 0
    total_heads: int = 1

    def __call__(
        self,
        probs: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        seq: int,
        first_row: int = 0,
    ) -> torch.Tensor:
        """probs [b, n, sq, sk] of batch rows first_row ... first_row + b - 1, dropped."""
        b, n = probs.shape[:2]
        rows = (
            (first_row + torch.arange(b, device=probs.device))[:, None] * self.total_heads
            + self.head_offset
            + torch.arange(n, device=probs.device)
        )
        index = (rows[:, :, None, None] * seq + q_pos[:, None]) * seq + k_pos
        return ops.dropout(probs, self.p, self.key, index=index)


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def positions(seq: int, size: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions of the tokens context-parallel rank `rank` of `size` holds, in its
    order."""
    if size == 1:
        return torch.arange(seq, device=device)
    if seq % (2 * size):
        raise ValueError(
            f"sequence length {seq} must be divisible by 2 x context-parallel size = {2 * size}"
        )
    c = seq // (2 * size)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c, device=device) for i in chunks_of(rank, size)]
    )


def document_blocks(
    spans: list[list[tuple[int, int]]], q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool
):
    """The pieces of an attention block in which queries see keys of their own document: (batch row,
    query rows, key rows, causal) in the block's own indices. q_pos, k_pos: the global positions
    (host, increasing) of the block's queries and keys; spans: each row's documents (start, end)
    (fmeg.ops.document_attention.document_spans). A causal block (q_pos == k_pos) gives causal
    pieces on its diagonal."""
    out = []
    for row, documents in enumerate(spans):
        bounds = torch.tensor([p for span in documents for p in span])
        qb, kb = (
            torch.searchsorted(q_pos, bounds).tolist(),
            torch.searchsorted(k_pos, bounds).tolist(),
        )
        for j in range(len(documents)):
            qa, qe, ka, ke = qb[2 * j], qb[2 * j + 1], kb[2 * j], kb[2 * j + 1]
            if qa < qe and ka < ke:
                out.append((row, slice(qa, qe), slice(ka, ke), causal))
    return out


def load_balanced_order(size: int) -> list[int]:
    """The chunks in rank order: what concatenating every rank's tokens gives."""
    return [i for r in range(size) for i in chunks_of(r, size)]


def reorder(x: torch.Tensor, dim: int, size: int, to_natural: bool = True) -> torch.Tensor:
    """Every rank's chunks concatenated in rank order along dim -> the sequence's order (or
    back)."""
    order = torch.tensor(load_balanced_order(size))
    chunk = x.shape[dim] // (2 * size)
    index = order.argsort() if to_natural else order
    return x.index_select(
        dim, (index[:, None] * chunk + torch.arange(chunk)).flatten().to(x.device)
    )
