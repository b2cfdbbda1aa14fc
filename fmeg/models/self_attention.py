"""A GPT layer's self-attention as pure functions: the grouped q-k-v projection (column-parallel),
RoPE, the attention core (causal, packed documents, context-parallel, sliding windows and sinks)
and the output projection (row-parallel).

The qkv rows are grouped per key/value head g: its N/G query heads, then its key, then its value
(fuse_qkv / split_qkv). A contiguous slice of rows is then a whole set of groups, which is what
tensor parallelism needs; the head counts are read from the weights' shapes, so each function runs
unchanged on a tensor-parallel shard (N/t query and G/t key/value heads).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from einops import rearrange

from fmeg import ops
from fmeg.models import mla
from fmeg.models.gpt_config import GPTConfig
from fmeg.models.norms import head_norm, norm
from fmeg.parallel import context
from fmeg.parallel.tensor import NO_TP, TensorParallel, column_parallel_linear, row_parallel_linear

Params = dict[str, Any]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Separate q [N*D, ...], k and v [G*D, ...] (weights or biases) -> the grouped qkv layout."""
    g = num_kv_heads
    q, k, v = (rearrange(t, "(g rd) ... -> g rd ...", g=g) for t in (q, k, v))
    return rearrange(torch.cat([q, k, v], dim=1), "g rd ... -> (g rd) ...")


def split_qkv(
    qkv: torch.Tensor, config: GPTConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: grouped qkv rows -> (q [N*D, ...], k [G*D, ...], v [G*D, ...])."""
    d, per_group = config.head_dim, config.heads_per_group
    grouped = rearrange(qkv, "(g rd) ... -> g rd ...", rd=(per_group + 2) * d)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return tuple(rearrange(t, "g rd ... -> (g rd) ...") for t in (q, k, v))


def attention(
    p: Params,
    x_BSH: torch.Tensor,
    config: GPTConfig,
    rope: tuple | None,
    tp: TensorParallel = NO_TP,
    key: Any = None,
    recompute: frozenset[str] = frozenset(),
    documents: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal self-attention over the heads held in p (all of them, or a tensor-parallel shard);
    with a key, attention dropout masks each probability by its global (batch, head, query, key)
    position. recompute: Megatron's --recompute-modules this layer recomputes; "core_attn" keeps
    only q, k and v of the attention core for backward, "mla_up_proj" only MLA's latents
    (fmeg.models.mla). documents: the rows' packed documents as host cu_seqlens [b, s + 1]
    (ops.document_attention), or None. window: this layer's sliding window (config.layer_window), or
    None; with it or with sinks (config.attention.softmax_type) the core is written out
    (sink_core)."""
    q, k, v = project_qkv(p, x_BSH, config, rope, tp, "mla_up_proj" in recompute)
    value_dim = v.shape[-1]
    if value_dim != q.shape[-1] and (documents is not None or tp.context.size > 1):
        # these cores take one head dimension
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - value_dim))
    offset = tp.rank * q.shape[1]
    sinks = attention_sinks(p, config, q)
    if window is not None or sinks is not None:
        core = sink_core(config, tp.context, key, offset, window, documents)
    # the sequence split over cp ranks
    elif tp.context.size > 1:
        core = context.core(
            tp.context, config.attention.dropout, key, offset, config.num_heads, documents
        )
    elif documents is not None:
        core = functools.partial(
            ops.document_attention,
            cu_seqlens=documents,
            dropout_p=config.attention.dropout,
            key=key,
            head_offset=offset,
            total_heads=config.num_heads,
        )
    else:
        core = functools.partial(
            ops.causal_attention,
            dropout_p=config.attention.dropout,
            key=key,
            head_offset=offset,
            total_heads=config.num_heads,
        )
    args = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = ops.recomputed(core, *args) if "core_attn" in recompute else core(*args)
    return project_out(p, out[..., :value_dim], tp)


def attention_sinks(p: Params, config: GPTConfig, q: torch.Tensor) -> torch.Tensor | None:
    """The sink logits of the heads of q [b, N, s, d]: the learnable ones in p (this rank's, split
    over tp as the heads are), zeros for off-by-one, None for the vanilla softmax."""
    if config.attention.softmax_type == "off-by-one":
        return torch.zeros(q.shape[1], device=q.device)
    return p.get("sinks")


def sink_core(
    config: GPTConfig,
    cp: context.ContextParallel,
    key: Any,
    head_offset: int,
    window: int | None,
    documents: torch.Tensor | None,
):
    """core(q, k, v, sinks=None) of a layer with sinks or a sliding window (ops.sink_attention).
    Under context parallelism each rank's queries attend to the whole sequence's keys and values,
    gathered as --cp-comm-type all_gather gathers them (whatever the comm type: the windows and
    sinks are in the mask and the softmax, which that core writes out)."""

    def core(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        seq = q.shape[2] * cp.size
        q_pos = context.positions(seq, cp.size, cp.rank, q.device)
        k_pos = torch.arange(seq, device=q.device)
        if cp.size > 1:
            k, v = context.whole_sequence(k, cp), context.whole_sequence(v, cp)
        drop = None
        if key is not None and config.attention.dropout > 0:
            keyed = context.AttentionDropout(
                config.attention.dropout, key, head_offset, config.num_heads
            )
            drop = functools.partial(keyed, seq=seq)
        keep = ops.visible(q_pos, k_pos, window, documents)
        return ops.sink_attention(q, k, v, keep, sinks=sinks, drop=drop, q_pos=q_pos, k_pos=k_pos)

    return core


def project_qkv(
    p: Params,
    x_BSH: torch.Tensor,
    config: GPTConfig,
    rope: tuple | None,
    tp: TensorParallel = NO_TP,
    recompute_up: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's input projection: q [b, N, s, d] and k, v [b, G, s, d] for the heads held in p
    (column- parallel: this rank's N/t and G/t), RoPE applied to q and k when rope is given.
    Multi-latent attention's (fmeg.models.mla) where p has its latent projections (recompute_up: its
    up-projections recomputed)."""
    if "kv_down" in p:
        return mla.project_qkv(
            p, x_BSH, config, rope, lambda q, x: norm(q, x, config, tp), tp, recompute_up
        )
    d, per_group = config.head_dim, config.heads_per_group
    qkv = column_parallel_linear(x_BSH, p["qkv"]["weight"], p["qkv"].get("bias"), tp, site="qkv")
    qkv = rearrange(qkv, "b s (g r d) -> b g r s d", r=per_group + 2, d=d)
    q = rearrange(qkv[:, :, :per_group], "b g r s d -> b (g r) s d")
    k, v = qkv[:, :, per_group], qkv[:, :, per_group + 1]
    if (
        config.attention.qk_norm
        # each head's queries and keys, before RoPE (Qwen3, Megatron's qk_layernorm)
    ):
        q, k = head_norm(p["q_norm"], q, config, tp), head_norm(p["k_norm"], k, config, tp)
    if rope is not None:
        q, k = _rotate(q, rope, config.rotary_dim), _rotate(k, rope, config.rotary_dim)
    return q, k, v


def rope_tables(positions: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin for these positions (Llama 3.1's frequency scaling, or YaRN's, when the
    config has it)."""
    c = config
    yarn = (
        (
            c.rope.yarn.factor,
            c.rope.yarn.original_max_position_embeddings,
            c.rope.yarn.beta_fast,
            c.rope.yarn.beta_slow,
            c.rope.yarn.mscale,
            c.rope.yarn.mscale_all_dim,
            c.rope.yarn.round_to_int,
        )
        if c.rope.kind == "yarn"
        else None
    )
    return ops.rope_cos_sin(positions, c.rotary_dim, c.rope.theta, c.rope.scaling, yarn)


def project_out(p: Params, out_BNSD: torch.Tensor, tp: TensorParallel = NO_TP) -> torch.Tensor:
    """Attention's output projection (row-parallel) of the heads' outputs [b, N, s, d] -> [b, s,
    h]."""
    out = rearrange(out_BNSD, "b n s d -> b s (n d)")
    return row_parallel_linear(out, p["proj"]["weight"], p["proj"].get("bias"), tp, site="proj")


def _rotate(x_BNSD: torch.Tensor, rope: tuple, rotary_dim: int) -> torch.Tensor:
    """RoPE on the first rotary_dim dimensions of each head; the rest pass through
    (--rotary-percent)."""
    if rotary_dim == x_BNSD.shape[-1]:
        return ops.apply_rope(x_BNSD, *rope)
    return torch.cat(
        [ops.apply_rope(x_BNSD[..., :rotary_dim], *rope), x_BNSD[..., rotary_dim:]], dim=-1
    )
