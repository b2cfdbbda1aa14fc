"""p2p (ring) and all_gather context-parallel attention: autograd Functions over attention blocks,
and the custom ops torch.compile sees instead of them.

    # this rank's rows of the whole causal attention
    out = blockwise(q, k, v, "p2p", group, handle, dropout)

q [b, N, 2c, d], k, v [b, G, 2c, d] hold this rank's chunks r and 2 size - 1 - r
(fmeg.parallel.context_layout). p2p passes key/value blocks around the ring (send to r + 1, receive
from r - 1) while each rank attends to the block it holds; all_gather gathers them once. Each
block's result merges by its log-sum-exp (fmeg.ops.attention_blocks); the backward passes take the
rows' merged out and lse, so the blocks' gradients add up to the whole attention's: in the ring the
key/value gradients travel with their blocks and arrive home after the last hop, the gathered ones
are reduce-scattered. Both Functions have grad, vjp and (without dropout) vmap rules, and no jvp
rule.

Under torch.compile each is one custom op each way (fmeg::context_attention and its backward) that
runs the eager code, point-to-point hand-offs and fused blocks included, so a compiled layer stays
one graph. A custom op takes no Python object, so it names its group by `handle`, the group's index
in a registry (register_group).
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg.ops import attention_blocks as blocks
from fmeg.ops.document_attention import document_spans
from fmeg.parallel.context_layout import (
    SEQ,
    AttentionDropout,
    chunks_of,
    document_blocks,
    positions,
    reorder,
)

# the groups compiled graphs reach by their index here (a custom op takes no Python object)
_GROUPS: list[Any] = []


def register_group(group: Any) -> int:
    """group's handle: its index in the registry (added if new); -1 for None."""
    if group is None:
        return -1
    for i, known in enumerate(_GROUPS):
        if known is group:
            return i
    _GROUPS.append(group)
    return len(_GROUPS) - 1


def blockwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm_type: str,
    group: Any,
    handle: int,
    dropout: AttentionDropout | None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """p2p or all_gather over group (this rank holding its chunks r and 2 size - 1 - r of the
    sequence); documents: host cu_seqlens [b, s + 1] of the whole sequence (each packed document
    attends to itself only), or None."""
    # one opaque op in the graph, running the code below
    if torch.compiler.is_compiling():
        d = dropout or AttentionDropout(0.0, None)
        return _attention_op(
            q, k, v, comm_type, handle, d.p, d.key, d.head_offset, d.total_heads, documents
        )[0]
    seq = q.shape[SEQ] * group.size
    spans = None if documents is None else document_spans(documents, seq)
    return _BLOCKS[comm_type].apply(q, k, v, group, _drop(dropout, seq), spans)[0]


def _drop(dropout: AttentionDropout | None, seq: int):
    """The blocks' dropout, (probs, q_pos, k_pos, first_row=0) -> dropped, of a whole sequence of
    seq tokens."""
    return (
        None
        if dropout is None
        else (lambda p, qp, kp, first_row=0: dropout(p, qp, kp, seq, first_row))
    )


# ------------------------------------------------------------------------------------------------
# packed documents: a block cut into the pieces where queries see keys of their own document


def _pieces(
    spans, rows: slice, cols: slice, causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor
):
    """(batch row, query rows, key rows, causal) of the block's document pieces in the Function's
    indices; q_pos, k_pos: the host positions of all its queries and keys."""
    r0, c0 = rows.start or 0, cols.start or 0
    return [
        (b, slice(r0 + qs.start, r0 + qs.stop), slice(c0 + ks.start, c0 + ks.stop), piece_causal)
        for b, qs, ks, piece_causal in document_blocks(spans, q_pos[rows], k_pos[cols], causal)
    ]


def _for_row(drop, b: int):
    return None if drop is None else (lambda p, qp, kp: drop(p, qp, kp, first_row=b))


def _forward_pieces(out, lse, q, k, v, pieces, drop, q_pos, k_pos) -> None:
    """Merge each piece's attention into out and lse (fresh tensors, written in place)."""
    for b, rows, cols, causal in pieces:
        r = slice(b, b + 1)
        o, block_lse = blocks.block_forward(
            q[r, :, rows],
            k[r, :, cols],
            v[r, :, cols],
            causal,
            _for_row(drop, b),
            q_pos[rows],
            k_pos[cols],
        )
        merged = blocks.merge(out[r, :, rows], lse[r, :, rows], o, block_lse)
        out[r, :, rows], lse[r, :, rows] = merged


def _backward_pieces(dout, q, k, v, out, lse, pieces, drop, q_pos, k_pos):
    """The pieces' gradients as ([(row, query rows, dq)], [(row, key rows, dk)], [(row, key rows,
    dv)])."""
    dq, dk, dv = [], [], []
    for b, rows, cols, causal in pieces:
        r = slice(b, b + 1)
        g = blocks.block_backward(
            dout[r, :, rows],
            q[r, :, rows],
            k[r, :, cols],
            v[r, :, cols],
            out[r, :, rows],
            lse[r, :, rows],
            causal,
            _for_row(drop, b),
            q_pos[rows],
            k_pos[cols],
        )
        dq.append((b, rows, g[0]))
        dk.append((b, cols, g[1]))
        dv.append((b, cols, g[2]))
    return dq, dk, dv


def _add_pieces(t: torch.Tensor, parts) -> torch.Tensor:
    """t [b, H, s, d] with each (row, rows, value [1, H, n, d]) added at its place: one index_add,
    out of place (backward may run under torch.func)."""
    if not parts:
        return t
    b, h, s, d = t.shape
    index = torch.cat(
        [torch.arange(row * s + sl.start, row * s + sl.stop) for row, sl, _ in parts]
    ).to(t.device)
    values = torch.cat([value[0].transpose(0, 1) for _, _, value in parts]).to(t.dtype)
    flat = t.transpose(1, 2).reshape(b * s, h, d).index_add(0, index, values)
    return flat.reshape(b, s, h, d).transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# the blocks each comm type computes


def _ring_blocks(rank: int, src: int, c: int):
    """(query rows, key rows, causal) of the block this rank computes with rank src's keys (p2p):
    its own chunks causally; an earlier rank's first chunk (its second comes after all of ours)
    fully; a later rank's both chunks fully, from our second chunk (our first comes before both)."""
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def _gathered_blocks(rank: int, size: int, c: int):
    """For each of our two chunks, its (query rows, key rows of the gathered natural-order sequence,
    causal) blocks (all_gather): every earlier chunk fully, itself causally."""
    out = []
    for half, chunk in enumerate(chunks_of(rank, size)):
        rows = slice(half * c, (half + 1) * c)
        out.append(
            ([(rows, slice(0, chunk * c), False)] if chunk else [])
            + [(rows, slice(chunk * c, (chunk + 1) * c), True)]
        )
    return out


def _add_rows(t: torch.Tensor, rows: slice, value: torch.Tensor) -> torch.Tensor:
    """t with value added to its sequence rows `rows`, out of place (backward may run under
    torch.func)."""
    index = torch.arange(t.shape[SEQ], device=t.device)[rows]
    return t.index_add(SEQ, index, value.to(t.dtype))


def _shift(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Send x to the next rank of the ring, receive the previous rank's."""
    group.send(x, (group.rank + 1) % group.size)
    return group.recv((group.rank - 1) % group.size)


def _vmap_rule(fn):
    """A vmap rule for a Function over [b, heads, s, d] that treats batch rows independently: the
    vmapped dimension joins the batch (not with dropout, whose mask is keyed by the batch row)."""

    def vmap(info, in_dims, q, k, v, group, drop, spans):
        if drop is not None:
            raise NotImplementedError("context-parallel attention dropout under vmap")
        size = info.batch_size
        q, k, v = (
            t.unsqueeze(0).expand(size, *t.shape) if d is None else t.movedim(d, 0)
            for t, d in zip((q, k, v), in_dims[:3])
        )
        out, lse = fn.apply(
            *(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)),
            group,
            drop,
            None if spans is None else spans * size,
        )
        return (out.reshape(size, -1, *out.shape[1:]), lse.reshape(size, -1, *lse.shape[1:])), (
            0,
            0,
        )

    return staticmethod(vmap)


class _BlockAttention(torch.autograd.Function):
    """What the ring and the gathered attention share: both save q, k, v and the rows' merged out
    and lse, which every block's backward takes (fmeg.ops.attention_blocks); `gradients` is each
    one's backward pass. spans: each batch row's packed documents
    (fmeg.ops.document_attention.document_spans), or None."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ctx.group, ctx.drop, ctx.spans = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.mark_non_differentiable(output[1])

    @classmethod
    def backward(cls, ctx, dout, _dlse):
        return (
            *cls.gradients(dout, *ctx.saved_tensors, ctx.group, ctx.drop, ctx.spans),
            None,
            None,
            None,
        )


class _Ring(_BlockAttention):
    @staticmethod
    def forward(q, k, v, group, drop, spans):
        if spans is not None:
            return _ring_documents(q, k, v, group, drop, spans)
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
            o, block_lse = blocks.block_forward(
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                causal,
                drop,
                q_pos[rows],
                k_pos,
            )
            if rows == slice(None):
                out, lse = blocks.merge(out, lse, o, block_lse)
            else:
                merged = blocks.merge(out[:, :, rows], lse[:, :, rows], o, block_lse)
                out, lse = (
                    torch.cat([out[:, :, :c], merged[0]], SEQ),
                    torch.cat([lse[:, :, :c], merged[1]], SEQ),
                )
        group.finish()
        return out.to(q.dtype), lse

    @staticmethod
    def gradients(dout, q, k, v, out, lse, group, drop, spans):
        if spans is not None:
            return _ring_document_gradients(dout, q, k, v, out, lse, group, drop, spans)
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        q_pos = positions(2 * c * size, size, rank, q.device)
        dq = torch.zeros_like(q, dtype=blocks._accumulate(q))
        kv, dkv = (
            torch.stack([k, v]),
            torch.zeros(2, *k.shape, dtype=blocks._accumulate(k), device=k.device),
        )
        for step in range(size):
            # we hold src's keys and the gradient they have gathered so far
            src = (rank - step) % size
            if step:
                kv = _shift(kv, group)
            rows, cols, causal = _ring_blocks(rank, src, c)
            k_pos = positions(2 * c * size, size, src, q.device)[cols]
            dq_b, dk_b, dv_b = blocks.block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                drop,
                q_pos[rows],
                k_pos,
            )
            dq = _add_rows(dq, rows, dq_b)
            dkv = torch.stack([_add_rows(dkv[0], cols, dk_b), _add_rows(dkv[1], cols, dv_b)])
            # on to the next rank; after the last step our own block's comes home
            dkv = _shift(dkv, group)
        group.finish()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


_Ring.vmap = _vmap_rule(_Ring)


def _empty_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out 0 and lse -inf for every row of q: what rows that have seen no key yet merge from."""
    acc = blocks._accumulate(q)
    return torch.zeros_like(q, dtype=acc), torch.full(
        q.shape[:3], float("-inf"), dtype=acc, device=q.device
    )


def _ring_steps(q, k, v, group, spans):
    """The ring over packed documents, step by step: (keys and values held, their document pieces
    against our queries, their positions), after which the caller's group.finish()."""
    rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
    host_q, kv = positions(2 * c * size, size, rank), torch.stack([k, v])
    for step in range(size):
        src = (rank - step) % size
        if step:
            kv = _shift(kv, group)
        host_k = positions(2 * c * size, size, src)
        yield kv, _pieces(spans, *_ring_blocks(rank, src, c), host_q, host_k), host_k.to(q.device)


def _ring_documents(q, k, v, group, drop, spans):
    """_Ring.forward over packed documents: each block of the ring cut into its document pieces."""
    q_pos, (out, lse) = (
        positions(q.shape[SEQ] * group.size, group.size, group.rank, q.device),
        _empty_rows(q),
    )
    for kv, pieces, k_pos in _ring_steps(q, k, v, group, spans):
        _forward_pieces(out, lse, q, kv[0], kv[1], pieces, drop, q_pos, k_pos)
    group.finish()
    return out.to(q.dtype), lse


def _ring_document_gradients(dout, q, k, v, out, lse, group, drop, spans):
    """_Ring.gradients over packed documents: the key/value gradients travel with their blocks, as
    there."""
    q_pos, dq_parts = positions(q.shape[SEQ] * group.size, group.size, group.rank, q.device), []
    dkv = torch.zeros(2, *k.shape, dtype=blocks._accumulate(k), device=k.device)
    for kv, pieces, k_pos in _ring_steps(q, k, v, group, spans):
        dq_p, dk_p, dv_p = _backward_pieces(
            dout, q, kv[0], kv[1], out, lse, pieces, drop, q_pos, k_pos
        )
        dq_parts += dq_p
        dkv = _shift(torch.stack([_add_pieces(dkv[0], dk_p), _add_pieces(dkv[1], dv_p)]), group)
    group.finish()
    dq = _add_pieces(torch.zeros_like(q, dtype=blocks._accumulate(q)), dq_parts)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _Gathered(_BlockAttention):
    @staticmethod
    def forward(q, k, v, group, drop, spans):
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        kv = reorder(group.all_gather(torch.stack([k, v]), SEQ + 1), SEQ + 1, size)
        if spans is not None:
            host_q, host_k = positions(2 * c * size, size, rank), torch.arange(2 * c * size)
            out, lse = _empty_rows(q)
            for rows, cols, causal in (b for half in _gathered_blocks(rank, size, c) for b in half):
                _forward_pieces(
                    out,
                    lse,
                    q,
                    kv[0],
                    kv[1],
                    _pieces(spans, rows, cols, causal, host_q, host_k),
                    drop,
                    host_q.to(q.device),
                    host_k.to(q.device),
                )
            return out.to(q.dtype), lse
        q_pos, k_pos = (
            positions(2 * c * size, size, rank, q.device),
            torch.arange(2 * c * size, device=q.device),
        )
        halves = []
        for half_blocks in _gathered_blocks(rank, size, c):
            o = block_lse = None
            for rows, cols, causal in half_blocks:
                ob, lb = blocks.block_forward(
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    causal,
                    drop,
                    q_pos[rows],
                    k_pos[cols],
                )
                o, block_lse = blocks.merge(o, block_lse, ob, lb)
            halves.append((o, block_lse))
        out, lse = (torch.cat(parts, SEQ) for parts in zip(*halves))
        return out.to(q.dtype), lse

    @staticmethod
    def gradients(dout, q, k, v, out, lse, group, drop, spans):
        rank, size, c = group.rank, group.size, q.shape[SEQ] // 2
        kv = reorder(group.all_gather(torch.stack([k, v]), SEQ + 1), SEQ + 1, size)
        q_pos, k_pos = (
            positions(2 * c * size, size, rank, q.device),
            torch.arange(2 * c * size, device=q.device),
        )
        dq, dkv = (
            torch.zeros_like(q, dtype=blocks._accumulate(q)),
            torch.zeros_like(kv, dtype=blocks._accumulate(kv)),
        )
        if spans is not None:
            host_q, host_k = positions(2 * c * size, size, rank), torch.arange(2 * c * size)
            pieces = [
                p
                for half in _gathered_blocks(rank, size, c)
                for block in half
                for p in _pieces(spans, *block, host_q, host_k)
            ]
            dq_p, dk_p, dv_p = _backward_pieces(
                dout, q, kv[0], kv[1], out, lse, pieces, drop, q_pos, k_pos
            )
            dq, dkv = (
                _add_pieces(dq, dq_p),
                torch.stack([_add_pieces(dkv[0], dk_p), _add_pieces(dkv[1], dv_p)]),
            )
        for rows, cols, causal in (
            b for half in _gathered_blocks(rank, size, c) for b in half if spans is None
        ):
            dq_b, dk_b, dv_b = blocks.block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                drop,
                q_pos[rows],
                k_pos[cols],
            )
            dq = _add_rows(dq, rows, dq_b)
            dkv = torch.stack([_add_rows(dkv[0], cols, dk_b), _add_rows(dkv[1], cols, dv_b)])
        mine = group.reduce_scatter(reorder(dkv, SEQ + 1, size, to_natural=False), SEQ + 1)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


_Gathered.vmap = _vmap_rule(_Gathered)
_BLOCKS = {"p2p": _Ring, "all_gather": _Gathered}


# ------------------------------------------------------------------------------------------------
# the twin torch.compile sees: the ring and the gathered attention as opaque custom ops (their
# send/recv and host-side loops stay out of the graph), forward and backward each one op that runs
# the eager code above

Tensor = torch.Tensor


def _resolved(
    q: Tensor,
    comm_type: str,
    handle: int,
    dropout_p: float,
    key: Tensor | None,
    head_offset: int,
    total_heads: int,
    documents: Tensor | None,
):
    group = _GROUPS[handle]
    dropout = (
        None
        if key is None or dropout_p == 0.0
        else AttentionDropout(dropout_p, key, head_offset, total_heads)
    )
    seq = q.shape[SEQ] * group.size
    spans = None if documents is None else document_spans(documents, seq)
    return _BLOCKS[comm_type], group, _drop(dropout, seq), spans


@torch.library.custom_op("fmeg::context_attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    comm_type: str,
    handle: int,
    dropout_p: float,
    key: Tensor | None,
    head_offset: int,
    total_heads: int,
    documents: Tensor | None,
) -> tuple[Tensor, Tensor]:
    fn, group, drop, spans = _resolved(
        q, comm_type, handle, dropout_p, key, head_offset, total_heads, documents
    )
    return _contiguous(fn.forward(q, k, v, group, drop, spans))


def _contiguous(tensors):
    """A custom op's outputs, laid out as its fake ones say (contiguous) and views of nothing (dk
    and dv can be views of one stacked buffer)."""
    return tuple(
        t.clone(memory_format=torch.contiguous_format)
        if t._base is not None or not t.is_contiguous()
        else t
        for t in tensors
    )


@_attention_op.register_fake
def _(q, k, v, comm_type, handle, dropout_p, key, head_offset, total_heads, documents):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=blocks._accumulate(q))


@torch.library.custom_op("fmeg::context_attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    comm_type: str,
    handle: int,
    dropout_p: float,
    key: Tensor | None,
    head_offset: int,
    total_heads: int,
    documents: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    fn, group, drop, spans = _resolved(
        q, comm_type, handle, dropout_p, key, head_offset, total_heads, documents
    )
    return _contiguous(fn.gradients(dout, q, k, v, out, lse, group, drop, spans))


@_attention_backward_op.register_fake
def _(
    dout, q, k, v, out, lse, comm_type, handle, dropout_p, key, head_offset, total_heads, documents
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_setup_context(ctx, inputs, output):
    q, k, v, comm_type, handle, dropout_p, key, head_offset, total_heads, documents = inputs
    ctx.args = (comm_type, handle, dropout_p, head_offset, total_heads)
    # the optional tensors saved after q, k, v, out and lse
    ctx.present = (key is not None, documents is not None)
    ctx.save_for_backward(q, k, v, *output, *(t for t in (key, documents) if t is not None))


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, *optional = ctx.saved_tensors
    comm_type, handle, dropout_p, head_offset, total_heads = ctx.args
    key, documents = (optional.pop(0) if present else None for present in ctx.present)
    grads = _attention_backward_op(
        dout,
        q,
        k,
        v,
        out,
        lse,
        comm_type,
        handle,
        dropout_p,
        key,
        head_offset,
        total_heads,
        documents,
    )
    return *grads, None, None, None, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup_context)
