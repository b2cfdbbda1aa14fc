"""Context parallelism: causal attention over a sequence split between the ranks of a context-parallel group.

The sequence is cut into 2 x cp chunks of c = s / (2 cp) tokens; rank r holds chunks r and 2cp - 1 - r
(Megatron's get_batch_on_this_cp_rank), so every rank does the same share of the causal work. Everything
outside attention is per token and runs on the rank's 2c tokens unchanged (RoPE and dropout take the tokens'
global positions, `positions`). Attention needs the other ranks' keys and values, by one of Megatron's
--cp-comm-type values:

    p2p         ring attention: key/value blocks pass around the ring (send to r + 1, receive from r - 1) while
                each rank attends to the block it holds; results merge by their log-sum-exp; in backward the
                key/value gradients travel around the ring with their blocks
    all_gather  keys and values all-gathered once, queries local; the backward reduce-scatters their gradients
    a2a         (Ulysses) an all-to-all swaps the sequence split for a head split (heads and key/value heads
                divisible by cp), one device's attention on the whole sequence, and an all-to-all back

Contract: q [b, N, 2c, d], k, v [b, G, 2c, d] hold this rank's chunks (in the order above); the result is this
rank's rows of the one-device causal attention of the whole sequence, and the gradients of q, k and v are this
rank's rows of one device's. p2p and all_gather are autograd Functions with grad, vjp and (without dropout)
vmap rules, under torch.func too, and no jvp rule; a2a is built from the differentiable all-to-all and one
device's attention, so it has every torch.func rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg import ops
from fmeg.ops import attention_blocks as blocks
from fmeg.parallel import collectives as C

COMM_TYPES = ("p2p", "all_gather", "a2a")
SEQ = 2  # the sequence dimension of [b, heads, s, d]


@dataclass(frozen=True)
class ContextParallel:
    group: Any = None  # a fmeg.parallel.comm Group over the cp ranks, or None for one rank
    comm_type: str | tuple[str, ...] = "p2p"  # one for every layer, or one per layer (Megatron's list form)

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    def for_layer(self, index: int) -> ContextParallel:
        """The comm type of layer `index` (a list gives each layer its own)."""
        if isinstance(self.comm_type, str):
            return self
        return ContextParallel(self.group, self.comm_type[index])


NO_CP = ContextParallel()


@dataclass(frozen=True)
class AttentionDropout:
    """Attention dropout keyed as one device's (fmeg.ops.attention): each probability by its global (batch row,
    head, query, key) position; these heads are heads head_offset ... of total_heads."""
    p: float
    key: Any
    head_offset: int = 0
    total_heads: int = 1

    def __call__(self, probs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, seq: int) -> torch.Tensor:
        b, n = probs.shape[:2]
        rows = torch.arange(b, device=probs.device)[:, None] * self.total_heads + self.head_offset + \
            torch.arange(n, device=probs.device)
        index = (rows[:, :, None, None] * seq + q_pos[:, None]) * seq + k_pos
        return ops.dropout(probs, self.p, self.key, index=index)


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def positions(seq: int, size: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions of the tokens context-parallel rank `rank` of `size` holds, in its order."""
    if size == 1:
        return torch.arange(seq, device=device)
    if seq % (2 * size):
        raise ValueError(f"sequence length {seq} must be divisible by 2 x context-parallel size = {2 * size}")
    c = seq // (2 * size)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks_of(rank, size)])


def shard_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (a batch's tokens, labels, masks: dim 1)."""
    if cp.size == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp.size, cp.rank, x.device))


def load_balanced_order(size: int) -> list[int]:
    """The chunks in rank order: what concatenating every rank's tokens gives."""
    return [i for r in range(size) for i in chunks_of(r, size)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
              dropout: AttentionDropout | None = None) -> torch.Tensor:
    """This rank's rows of causal attention over the whole sequence (see the module docstring), with attention
    dropout keyed by global positions when given."""
    if cp.size == 1 or cp.comm_type == "a2a":
        return ulysses(q, k, v, cp, dropout)
    seq = q.shape[SEQ] * cp.size
    drop = None if dropout is None else (lambda p, qp, kp: dropout(p, qp, kp, seq))  # noqa: E731
    fn = {"p2p": _Ring, "all_gather": _Gathered}[cp.comm_type]
    return fn.apply(q, k, v, cp.group, drop)[0]


def core(cp: ContextParallel, dropout_p: float, key: Any, head_offset: int, total_heads: int):
    """attention(q, k, v) over cp, with the model's attention dropout (keyed as one device's) when key is given."""
    drop = None if key is None or dropout_p == 0.0 else AttentionDropout(dropout_p, key, head_offset, total_heads)
    return lambda q, k, v: attention(q, k, v, cp, drop)


# ---------------------------------------------------------------------------------------------------
# the blocks each comm type computes


def _ring_blocks(rank: int, src: int, c: int):
    """(query rows, key rows, causal) of the block this rank computes with rank src's keys (p2p): its own chunks
    causally; an earlier rank's first chunk (its second comes after all of ours) fully; a later rank's both chunks
    fully, from our second chunk (our first comes before both)."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _gathered_blocks(rank: int, size: int, c: int):
    """For each of our two chunks, its (query rows, key rows of the gathered natural-order sequence, causal)
    blocks (all_gather): every earlier chunk fully, itself causally."""
    out = []
    for half, chunk in enumerate(chunks_of(rank, size)):
        rows = slice(half * c, (half + 1) * c)
        out.append(([(rows, slice(0, chunk * c), False)] if chunk else []) +
                   [(rows, slice(chunk * c, (chunk + 1) * c), True)])
    return out


def _add_rows(t: torch.Tensor, rows: slice, value: torch.Tensor) -> torch.Tensor:
    """t with value added to its sequence rows `rows`, out of place (backward may run under torch.func)."""
    index = torch.arange(t.shape[SEQ], device=t.device)[rows]
    return t.index_add(SEQ, index, value.to(t.dtype))


def _shift(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Send x to the next rank of the ring, receive the previous rank's."""
    group.send(x, (group.rank + 1) % group.size)
    return group.recv((group.rank - 1) % group.size)


def _vmap_rule(fn):
    """A vmap rule for a Function over [b, heads, s, d] that treats batch rows independently: the vmapped
    dimension joins the batch (not with dropout, whose mask is keyed by the batch row)."""

    def vmap(info, in_dims, q, k, v, group, drop):
        if drop is not None:
            raise NotImplementedError("context-parallel attention dropout under vmap")
        size = info.batch_size
        q, k, v = (t.unsqueeze(0).expand(size, *t.shape) if d is None else t.movedim(d, 0)
                   for t, d in zip((q, k, v), in_dims[:3]))
        out, lse = fn.apply(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), group, drop)
        return (out.reshape(size, -1, *out.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (0, 0)

    return staticmethod(vmap)


class _BlockAttention(torch.autograd.Function):
    """What the ring and the gathered attention share: both save q, k, v and the rows' merged out and lse, which
    every block's backward takes (fmeg.ops.attention_blocks)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.group, ctx.drop = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])


class _Ring(_BlockAttention):

    @staticmethod
    def forward(q, k, v, group, drop):
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        q_pos = positions(2 * c * size, size, rank, q.device)
        out = lse = None
        kv = torch.stack([k, v])
        for step in range(size):
            src = (rank - step) % size
            if step:
                kv = _shift(kv, group)
            rows, cols, causal = _ring_blocks(rank, src, c)
            k_pos = positions(2 * c * size, size, src, q.device)[cols]
            o, l = blocks.block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, drop,
                                        q_pos[rows], k_pos)
            if rows == slice(None):
                out, lse = blocks.merge(out, lse, o, l)
            else:
                merged = blocks.merge(out[:, :, rows], lse[:, :, rows], o, l)
                out, lse = torch.cat([out[:, :, :c], merged[0]], SEQ), torch.cat([lse[:, :, :c], merged[1]], SEQ)
        group.finish()
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        (q, k, v, out, lse), group, drop = ctx.saved_tensors, ctx.group, ctx.drop
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        q_pos = positions(2 * c * size, size, rank, q.device)
        dq = torch.zeros_like(q, dtype=blocks._accumulate(q))
        kv, dkv = torch.stack([k, v]), torch.zeros(2, *k.shape, dtype=blocks._accumulate(k), device=k.device)
        for step in range(size):
            src = (rank - step) % size  # we hold src's keys and the gradient they have gathered so far
            if step:
                kv = _shift(kv, group)
            rows, cols, causal = _ring_blocks(rank, src, c)
            k_pos = positions(2 * c * size, size, src, q.device)[cols]
            dq_b, dk_b, dv_b = blocks.block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                                     kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows], causal,
                                                     drop, q_pos[rows], k_pos)
            dq = _add_rows(dq, rows, dq_b)
            dkv = torch.stack([_add_rows(dkv[0], cols, dk_b), _add_rows(dkv[1], cols, dv_b)])
            dkv = _shift(dkv, group)  # on to the next rank; after the last step our own block's comes home
        group.finish()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


_Ring.vmap = _vmap_rule(_Ring)


class _Gathered(_BlockAttention):

    @staticmethod
    def forward(q, k, v, group, drop):
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        kv = _reorder(group.all_gather(torch.stack([k, v]), SEQ + 1), SEQ + 1, size)
        q_pos, k_pos = positions(2 * c * size, size, rank, q.device), torch.arange(2 * c * size, device=q.device)
        halves = []
        for half_blocks in _gathered_blocks(rank, size, c):
            o = l = None
            for rows, cols, causal in half_blocks:
                ob, lb = blocks.block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, drop,
                                              q_pos[rows], k_pos[cols])
                o, l = blocks.merge(o, l, ob, lb)
            halves.append((o, l))
        out, lse = (torch.cat(parts, SEQ) for parts in zip(*halves))
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        (q, k, v, out, lse), group, drop = ctx.saved_tensors, ctx.group, ctx.drop
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        kv = _reorder(group.all_gather(torch.stack([k, v]), SEQ + 1), SEQ + 1, size)
        q_pos, k_pos = positions(2 * c * size, size, rank, q.device), torch.arange(2 * c * size, device=q.device)
        dq, dkv = torch.zeros_like(q, dtype=blocks._accumulate(q)), torch.zeros_like(kv, dtype=blocks._accumulate(kv))
        for rows, cols, causal in (b for half in _gathered_blocks(rank, size, c) for b in half):
            dq_b, dk_b, dv_b = blocks.block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                                     kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows], causal,
                                                     drop, q_pos[rows], k_pos[cols])
            dq = _add_rows(dq, rows, dq_b)
            dkv = torch.stack([_add_rows(dkv[0], cols, dk_b), _add_rows(dkv[1], cols, dv_b)])
        mine = group.reduce_scatter(_reorder(dkv, SEQ + 1, size, to_natural=False), SEQ + 1)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


_Gathered.vmap = _vmap_rule(_Gathered)


def _reorder(x: torch.Tensor, dim: int, size: int, to_natural: bool = True) -> torch.Tensor:
    """Every rank's chunks concatenated in rank order along dim -> the sequence's order (or back)."""
    order = torch.tensor(load_balanced_order(size))
    chunk = x.shape[dim] // (2 * size)
    index = order.argsort() if to_natural else order
    return x.index_select(dim, (index[:, None] * chunk + torch.arange(chunk)).flatten().to(x.device))


def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
            dropout: AttentionDropout | None) -> torch.Tensor:
    """a2a: heads split over cp instead of the sequence for the attention itself (DeepSpeed-Ulysses), one device's
    attention (fmeg.ops.causal_attention) on the whole sequence in between."""
    size, n, g = cp.size, q.shape[1], k.shape[1]
    if n % size or g % size:
        raise ValueError(f"the a2a context parallelism splits heads: {n} query and {g} key/value heads must be "
                         f"divisible by cp={size}")
    if size > 1:  # [b, heads / cp, s (chunks in rank order), d], then the sequence's order
        q, k, v = (_reorder(C.all_to_all(t, cp.group, 1, SEQ), SEQ, size) for t in (q, k, v))
    if dropout is None:
        out = ops.causal_attention(q, k, v)
    else:
        out = ops.causal_attention(q, k, v, dropout_p=dropout.p, key=dropout.key, total_heads=dropout.total_heads,
                                   head_offset=dropout.head_offset + cp.rank * q.shape[1])
    return out if size == 1 else C.all_to_all(_reorder(out, SEQ, size, to_natural=False), cp.group, SEQ, 1)
