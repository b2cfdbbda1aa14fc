"""Context parallelism: causal attention over a sequence split between the ranks of a
context-parallel group.

The sequence is cut into 2 x cp chunks of c = s / (2 cp) tokens; rank r holds chunks r and 2cp - 1 -
r (Megatron's get_batch_on_this_cp_rank), so every rank does the same share of the causal work
(fmeg.parallel.context_layout). Everything outside attention is per token and runs on the rank's 2c
tokens unchanged (RoPE and dropout take the tokens' global positions, `positions`). Attention needs
the other ranks' keys and values, by one of Megatron's --cp-comm-type values:

    p2p         ring attention (fmeg.parallel.ring_attention): key/value blocks pass around the
                ring while each rank attends to the block it holds; results merge by their
                log-sum-exp
    all_gather  keys and values all-gathered once, queries local (fmeg.parallel.ring_attention)
    a2a         (Ulysses) an all-to-all swaps the sequence split for a head split (heads and
                key/value heads divisible by cp), one device's attention on the whole sequence,
                and an all-to-all back
    a2a+p2p     (--hierarchical-context-parallel-sizes a p) a2a within groups of a consecutive cp
                ranks, then a ring of p over the groups

Contract: q [b, N, 2c, d], k, v [b, G, 2c, d] hold this rank's chunks (in the order above); the
result is this rank's rows of the one-device causal attention of the whole sequence, and the
gradients of q, k and v are this rank's rows of one device's. p2p and all_gather are autograd
Functions with grad, vjp and (without dropout) vmap rules, and no jvp rule; a2a is built from the
differentiable all-to-all and one device's attention, so it has every torch.func rule. Under
torch.compile, p2p and all_gather are one opaque custom op each way, so a compiled layer stays one
graph; a2a is traced like any tensor-parallel layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from fmeg import ops
from fmeg.parallel import collectives as C
from fmeg.parallel.context_layout import (
    SEQ,
    AttentionDropout,
    chunks_of,
    load_balanced_order,
    positions,
    reorder,
)
from fmeg.parallel.ring_attention import blockwise, register_group

__all__ = [
    "COMM_TYPES",
    "ContextParallel",
    "NO_CP",
    "AttentionDropout",
    "attention",
    "chunks_of",
    "core",
    "hierarchical",
    "load_balanced_order",
    "positions",
    "shard_batch",
    "shard_sequence",
    "ulysses",
    "whole_sequence",
]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass(frozen=True)
class ContextParallel:
    # a fmeg.parallel.comm Group over the cp ranks, or None for one rank
    group: Any = None
    # one for every layer, or one per layer (Megatron's list form)
    comm_type: str | tuple[str, ...] = "p2p"
    # a2a+p2p: its a2a level, consecutive cp ranks (mesh group cp_a2a); None: one rank
    a2a_group: Any = None
    # a2a+p2p: its p2p level, the ring over the a2a groups (mesh group cp_p2p)
    p2p_group: Any = None
    # the handles of group and p2p_group (fmeg.parallel.ring_attention.register_group), set when
    # made
    handles: tuple[int, int] = field(default=(-1, -1), compare=False, repr=False)

    def __post_init__(self):
        if self.handles == (-1, -1):
            object.__setattr__(
                self, "handles", (register_group(self.group), register_group(self.p2p_group))
            )

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    def for_layer(self, index: int) -> ContextParallel:
        """The comm type of layer `index` (a list gives each layer its own; layers past it,
        multi-token prediction's, take the last one's)."""
        if isinstance(self.comm_type, str):
            return self
        comm_type = self.comm_type[min(index, len(self.comm_type) - 1)]
        return ContextParallel(self.group, comm_type, self.a2a_group, self.p2p_group, self.handles)


NO_CP = ContextParallel()


def shard_sequence(x: torch.Tensor, cp: ContextParallel, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor (a batch's tokens, labels, masks: dim 1)."""
    if cp.size == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp.size, cp.rank, x.device))


# a microbatch's document boundaries: every rank reads all of them
WHOLE_SEQUENCE_KEYS = ("cu_seqlens",)


def shard_batch(batch: dict, cp: ContextParallel) -> dict:
    """This rank's part of a microbatch: its tokens of every [b, s] tensor (shard_sequence), the
    packed documents' boundaries (cu_seqlens, of the whole sequence) as they are."""
    return {k: t if k in WHOLE_SEQUENCE_KEYS else shard_sequence(t, cp) for k, t in batch.items()}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    dropout: AttentionDropout | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's rows of causal attention over the whole sequence (see the module docstring), with
    attention dropout keyed by global positions when given; documents: host cu_seqlens [b, s + 1] of
    the whole sequence, each packed document attending to itself (fmeg.ops.document_attention)."""
    if cp.size == 1 or cp.comm_type == "a2a":
        return ulysses(q, k, v, cp, dropout, documents)
    if cp.comm_type == "a2a+p2p":
        return hierarchical(q, k, v, cp, dropout, documents)
    return blockwise(q, k, v, cp.comm_type, cp.group, cp.handles[0], dropout, documents)


def whole_sequence(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Every rank's chunks of x [b, heads, 2c, d] gathered, in the sequence's order [b, heads, s,
    d]; the backward sums the ranks' gradients of them and keeps this rank's chunks (a
    reduce-scatter)."""
    return x if cp.size == 1 else reorder(C.gather_from_sp(x, cp.group, SEQ), SEQ, cp.size)


def core(
    cp: ContextParallel,
    dropout_p: float,
    key: Any,
    head_offset: int,
    total_heads: int,
    documents: torch.Tensor | None = None,
):
    """attention(q, k, v) over cp, with the model's attention dropout (keyed as one device's) when
    key is given."""
    drop = (
        None
        if key is None or dropout_p == 0.0
        else AttentionDropout(dropout_p, key, head_offset, total_heads)
    )
    return lambda q, k, v: attention(q, k, v, cp, drop, documents)


def ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    dropout: AttentionDropout | None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """a2a: heads split over cp instead of the sequence for the attention itself
    (DeepSpeed-Ulysses), one device's attention (fmeg.ops.causal_attention, or
    ops.document_attention over packed documents) on the whole sequence in between."""
    size, n, g = cp.size, q.shape[1], k.shape[1]
    if n % size or g % size:
        raise ValueError(
            f"the a2a context parallelism splits heads: {n} query and {g} key/value heads must be "
            f"divisible by cp={size}"
        )
    # [b, heads / cp, s (chunks in rank order), d], then the sequence's order
    if size > 1:
        q, k, v = (reorder(C.all_to_all(t, cp.group, 1, SEQ), SEQ, size) for t in (q, k, v))
    one_device = (
        ops.causal_attention
        if documents is None
        else functools.partial(ops.document_attention, cu_seqlens=documents)
    )
    if dropout is None:
        out = one_device(q, k, v)
    else:
        out = one_device(
            q,
            k,
            v,
            dropout_p=dropout.p,
            key=dropout.key,
            total_heads=dropout.total_heads,
            head_offset=dropout.head_offset + cp.rank * q.shape[1],
        )
    return (
        out
        if size == 1
        else C.all_to_all(reorder(out, SEQ, size, to_natural=False), cp.group, SEQ, 1)
    )


def hierarchical(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    dropout: AttentionDropout | None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """a2a+p2p (Megatron's --hierarchical-context-parallel-sizes a p, a x p = cp): an all-to-all
    over the a2a level (a consecutive cp ranks) splits heads and gathers those ranks' chunks, and a
    ring over the p2p level attends. With cp rank r = j a + i holding chunks r and 2cp - 1 - r, the
    a2a group j holds chunks ja ... ja + a - 1 and 2cp - (j + 1) a ... 2cp - 1 - ja: in order, big
    chunks j and 2p - 1 - j of the sequence cut into 2p, which is the ring's own layout at size
    p."""
    inner, outer = cp.a2a_group, cp.p2p_group
    a = 1 if inner is None else inner.size
    if q.shape[1] % a or k.shape[1] % a:
        raise ValueError(
            f"a2a+p2p splits heads over its a2a level: {q.shape[1]} query and {k.shape[1]} "
            f"key/value heads must be divisible by {a}"
        )
    if inner is not None:
        q, k, v = (_big_chunks(C.all_to_all(t, inner, 1, SEQ), a) for t in (q, k, v))
        # these heads are the a2a rank's share of the rank's
        if dropout is not None:
            dropout = AttentionDropout(
                dropout.p,
                dropout.key,
                dropout.head_offset + inner.rank * q.shape[1],
                dropout.total_heads,
            )
    # p = 1: the whole sequence, in order (Ulysses)
    if outer is None:
        out = ulysses(q, k, v, NO_CP, dropout, documents)
    # the big chunks are the ring's own layout of the whole sequence: the documents' positions hold
    else:
        out = blockwise(q, k, v, "p2p", outer, cp.handles[1], dropout, documents)
    return out if inner is None else C.all_to_all(_big_chunks(out, a, back=True), inner, SEQ, 1)


def _big_chunks(x: torch.Tensor, a: int, back: bool = False) -> torch.Tensor:
    """The a2a level's chunks, as received (rank i's first and second chunk, i = 0 ... a - 1), ->
    its two big chunks in sequence order (the first chunks ascending, then the second chunks
    descending), or back."""
    order = torch.tensor([2 * i for i in range(a)] + [2 * i + 1 for i in reversed(range(a))])
    index = order.argsort() if back else order
    chunk = x.shape[SEQ] // (2 * a)
    return x.index_select(
        SEQ, (index[:, None] * chunk + torch.arange(chunk)).flatten().to(x.device)
    )
