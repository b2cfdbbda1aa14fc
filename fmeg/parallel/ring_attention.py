"""p2p (ring) and all_gather context-parallel attention: autograd Functions over attention blocks, and the custom
ops torch.compile sees instead of them.

    out = blockwise(q, k, v, "p2p", group, handle, dropout)    # this rank's rows of the whole causal attention

q [b, N, 2c, d], k, v [b, G, 2c, d] hold this rank's chunks r and 2 size - 1 - r (fmeg.parallel.context_layout).
p2p passes key/value blocks around the ring (send to r + 1, receive from r - 1) while each rank attends to the
block it holds; all_gather gathers them once. Each block's result merges by its log-sum-exp
(fmeg.ops.attention_blocks); the backward passes take the rows' merged out and lse, so the blocks' gradients add
up to the whole attention's: in the ring the key/value gradients travel with their blocks and arrive home after
the last hop, the gathered ones are reduce-scattered. Both Functions have grad, vjp and (without dropout) vmap
rules, and no jvp rule.

Under torch.compile each is one custom op each way (fmeg::context_attention and its backward) that runs the eager
code, point-to-point hand-offs and fused blocks included, so a compiled layer stays one graph. A custom op takes
no Python object, so it names its group by `handle`, the group's index in a registry (register_group).
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg.ops import attention_blocks as blocks
from fmeg.parallel.context_layout import SEQ, AttentionDropout, chunks_of, positions, reorder

_GROUPS: list[Any] = []  # the groups compiled graphs reach by their index here (a custom op takes no Python object)


def register_group(group: Any) -> int:
    """group's handle: its index in the registry (added if new); -1 for None."""
    if group is None:
        return -1
    for i, known in enumerate(_GROUPS):
        if known is group:
            return i
    _GROUPS.append(group)
    return len(_GROUPS) - 1


def blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm_type: str, group: Any, handle: int,
              dropout: AttentionDropout | None) -> torch.Tensor:
    """p2p or all_gather over group (this rank holding its chunks r and 2 size - 1 - r of the sequence)."""
    if torch.compiler.is_compiling():  # one opaque op in the graph, running the code below
        d = dropout or AttentionDropout(0.0, None)
        return _attention_op(q, k, v, comm_type, handle, d.p, d.key, d.head_offset, d.total_heads)[0]
    return _BLOCKS[comm_type].apply(q, k, v, group, _drop(dropout, q.shape[SEQ] * group.size))[0]


def _drop(dropout: AttentionDropout | None, seq: int):
    """The blocks' dropout, (probs, q_pos, k_pos) -> dropped, of a whole sequence of seq tokens."""
    return None if dropout is None else (lambda p, qp, kp: dropout(p, qp, kp, seq))  # noqa: E731


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
    every block's backward takes (fmeg.ops.attention_blocks); `gradients` is each one's backward pass."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.group, ctx.drop = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])

    @classmethod
    def backward(cls, ctx, dout, _dlse):
        return *cls.gradients(dout, *ctx.saved_tensors, ctx.group, ctx.drop), None, None


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
    def gradients(dout, q, k, v, out, lse, group, drop):
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
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


_Ring.vmap = _vmap_rule(_Ring)


class _Gathered(_BlockAttention):

    @staticmethod
    def forward(q, k, v, group, drop):
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        kv = reorder(group.all_gather(torch.stack([k, v]), SEQ + 1), SEQ + 1, size)
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
    def gradients(dout, q, k, v, out, lse, group, drop):
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        kv = reorder(group.all_gather(torch.stack([k, v]), SEQ + 1), SEQ + 1, size)
        q_pos, k_pos = positions(2 * c * size, size, rank, q.device), torch.arange(2 * c * size, device=q.device)
        dq, dkv = torch.zeros_like(q, dtype=blocks._accumulate(q)), torch.zeros_like(kv, dtype=blocks._accumulate(kv))
        for rows, cols, causal in (b for half in _gathered_blocks(rank, size, c) for b in half):
            dq_b, dk_b, dv_b = blocks.block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                                     kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows], causal,
                                                     drop, q_pos[rows], k_pos[cols])
            dq = _add_rows(dq, rows, dq_b)
            dkv = torch.stack([_add_rows(dkv[0], cols, dk_b), _add_rows(dkv[1], cols, dv_b)])
        mine = group.reduce_scatter(reorder(dkv, SEQ + 1, size, to_natural=False), SEQ + 1)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


_Gathered.vmap = _vmap_rule(_Gathered)
_BLOCKS = {"p2p": _Ring, "all_gather": _Gathered}


# ---------------------------------------------------------------------------------------------------
# the twin torch.compile sees: the ring and the gathered attention as opaque custom ops (their send/recv and
# host-side loops stay out of the graph), forward and backward each one op that runs the eager code above

Tensor = torch.Tensor


def _resolved(q: Tensor, comm_type: str, handle: int, dropout_p: float, key: Tensor | None, head_offset: int,
              total_heads: int):
    group = _GROUPS[handle]
    dropout = None if key is None or dropout_p == 0.0 else AttentionDropout(dropout_p, key, head_offset, total_heads)
    return _BLOCKS[comm_type], group, _drop(dropout, q.shape[SEQ] * group.size)


@torch.library.custom_op("fmeg::context_attention", mutates_args=())
def _attention_op(q: Tensor, k: Tensor, v: Tensor, comm_type: str, handle: int, dropout_p: float,
                  key: Tensor | None, head_offset: int, total_heads: int) -> tuple[Tensor, Tensor]:
    fn, group, drop = _resolved(q, comm_type, handle, dropout_p, key, head_offset, total_heads)
    return _contiguous(fn.forward(q, k, v, group, drop))


def _contiguous(tensors):
    """A custom op's outputs, laid out as its fake ones say (contiguous) and views of nothing (dk and dv can be
    views of one stacked buffer)."""
    return tuple(t.clone(memory_format=torch.contiguous_format) if t._base is not None or not t.is_contiguous()
                 else t for t in tensors)


@_attention_op.register_fake
def _(q, k, v, comm_type, handle, dropout_p, key, head_offset, total_heads):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=blocks._accumulate(q))


@torch.library.custom_op("fmeg::context_attention_backward", mutates_args=())
def _attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, comm_type: str,
                           handle: int, dropout_p: float, key: Tensor | None, head_offset: int,
                           total_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    fn, group, drop = _resolved(q, comm_type, handle, dropout_p, key, head_offset, total_heads)
    return _contiguous(fn.gradients(dout, q, k, v, out, lse, group, drop))


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, comm_type, handle, dropout_p, key, head_offset, total_heads):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_setup_context(ctx, inputs, output):
    q, k, v, comm_type, handle, dropout_p, key, head_offset, total_heads = inputs
    ctx.args = (comm_type, handle, dropout_p, key is not None, head_offset, total_heads)
    ctx.save_for_backward(q, k, v, *output, *([] if key is None else [key]))


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, *key = ctx.saved_tensors
    comm_type, handle, dropout_p, _, head_offset, total_heads = ctx.args
    grads = _attention_backward_op(dout, q, k, v, out, lse, comm_type, handle, dropout_p, key[0] if key else None,
                                   head_offset, total_heads)
    return *grads, None, None, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)
