"""Multi-latent attention (DeepSeek-V2/V3's MLA, megatron-core's MLASelfAttention) as pure
functions.

Queries come from the hidden states directly (q) or through a low-rank latent (q_down, its norm,
q_up); keys and values come from one shared latent of kv_lora_rank dimensions (kv_down, its norm,
kv_up), plus a small rotary part of qk_pos_emb_head_dim dimensions shared by every head (the last
columns of kv_down's output). Each head's query and key are [qk_head_dim "nope" dims,
qk_pos_emb_head_dim rotated dims]; values have v_head_dim dims.

Parameters of one layer's attention (N heads, H hidden, dq = qk_head_dim, dr = qk_pos_emb_head_dim):

    q.weight         [N * (dq + dr), H]          q_lora_rank None       column-parallel (heads)
    q_down.weight    [q_lora_rank, H]            with q_lora_rank       replicated
    q_latent_norm    [q_lora_rank]
        with q_lora_rank and qk_norm (megatron-core's q_layernorm)
    q_up.weight      [N * (dq + dr), q_lora_rank]                       column-parallel (heads)
    kv_down.weight   [kv_lora_rank + dr, H]                             replicated
    kv_latent_norm   [kv_lora_rank]              with qk_norm (megatron-core's kv_layernorm)
    kv_up.weight     [N * (dq + dv), kv_lora_rank]
        column-parallel (heads): [k nope, v] per head
    proj.weight      [H, N * dv]                                        row-parallel

Sharding contract: under tensor parallelism a rank holds whole heads of q / q_up / kv_up / proj and
all of the replicated down projections, which run on its (sequence-sharded, under sp) tokens; their
gradients are summed over tp (fmeg.parallel.tensor.replicated_param), and the shared rotary key
enters the heads' work as any column-parallel input does (tensor.enter), so a shard computes exactly
its heads of the whole layer.

The rotary part is rotated as megatron-core rotates MLA's: its dimensions are first de-interleaved
(even ones, then odd ones), then "rotate half" RoPE (YaRN's frequencies with rope_type "yarn"). The
softmax scale is yarn_mscale(rotary_scaling_factor, mscale_all_dim)**2 / sqrt(dq + dr): the queries
are multiplied by the first factor, so any attention core (which divides by sqrt of the head
dimension) computes it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from einops import rearrange

from fmeg import ops
from fmeg.ops.rope import yarn_mscale
from fmeg.parallel.sharding import Partition
from fmeg.parallel.tensor import (
    NO_TP,
    TensorParallel,
    column_parallel_linear,
    enter,
    replicated_param,
)

Params = dict[str, Any]

TP_RULES = (
    ("layers.*.attn.q.weight", Partition(-2)),
    ("layers.*.attn.q_up.weight", Partition(-2)),
    ("layers.*.attn.kv_up.weight", Partition(-2)),
)


def q_head_dim(config) -> int:
    mla = config.attention.mla
    return mla.qk_head_dim + mla.qk_pos_emb_head_dim


def softmax_factor(config) -> float:
    """What the queries are multiplied by so that a core's 1/sqrt(d) softmax scale becomes MLA's."""
    yarn = config.rope.yarn
    return yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def validate(c, need: Callable) -> None:
    """GPTConfig's rules for multi-latent attention; need(ok, field, why) raises naming the
    field."""
    mla = c.attention.mla
    need(
        c.position == "rope",
        "position",
        "multi-latent attention rotates its own rotary part: use rope",
    )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        need(
            getattr(c.attention.mla, name) > 0,
            name,
            f"must be positive, got {getattr(c.attention.mla, name)}",
        )
    need(
        mla.q_lora_rank is None or mla.q_lora_rank > 0,
        "q_lora_rank",
        f"must be positive, got {mla.q_lora_rank}",
    )
    need(
        mla.qk_pos_emb_head_dim % 2 == 0,
        "qk_pos_emb_head_dim",
        f"must be even, got {mla.qk_pos_emb_head_dim}",
    )
    need(
        mla.v_head_dim <= q_head_dim(c),
        "v_head_dim",
        f"{mla.v_head_dim} must not exceed qk_head_dim + qk_pos_emb_head_dim",
    )
    need(
        c.num_kv_heads == c.num_heads, "num_kv_heads", "multi-latent attention has one key per head"
    )


def init_attention(
    config, seed: int, path: str, normal: Callable, linear_params: Callable, norm_params: Callable
) -> Params:
    """One layer's MLA parameters (megatron-core's init: std for every projection, the scaled std
    for proj)."""
    c = config
    mla = c.attention.mla
    std, out_std = c.init_std, c.init_std / (2.0 * c.num_layers) ** 0.5
    q_rows, kv_rows = c.num_heads * q_head_dim(c), c.num_heads * (mla.qk_head_dim + mla.v_head_dim)
    p: Params = {}
    if mla.q_lora_rank is None:
        p["q"] = linear_params((q_rows, c.hidden_size), std, False, seed, f"{path}.q")
    else:
        p["q_down"] = linear_params(
            (mla.q_lora_rank, c.hidden_size), std, False, seed, f"{path}.q_down"
        )
        if c.attention.qk_norm:
            p["q_latent_norm"] = norm_params(c, mla.q_lora_rank)
        p["q_up"] = linear_params((q_rows, mla.q_lora_rank), std, False, seed, f"{path}.q_up")
    p["kv_down"] = linear_params(
        (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, c.hidden_size),
        std,
        False,
        seed,
        f"{path}.kv_down",
    )
    if c.attention.qk_norm:
        p["kv_latent_norm"] = norm_params(c, mla.kv_lora_rank)
    p["kv_up"] = linear_params((kv_rows, mla.kv_lora_rank), std, False, seed, f"{path}.kv_up")
    p["proj"] = linear_params(
        (c.hidden_size, c.num_heads * mla.v_head_dim), out_std, c.bias, seed, f"{path}.proj"
    )
    return p


def project_qkv(
    p: Params,
    x_BSH: torch.Tensor,
    config,
    rope: tuple | None,
    norm: Callable,
    tp: TensorParallel = NO_TP,
    recompute_up: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [b, N, s, dq + dr] (q pre-multiplied by softmax_factor) and v [b, N, s, dv] for the
    heads held in p. rope: cos and sin tables of dr dimensions (rope_tables); norm(params, x): the
    model's norm of a latent, its weight replicated over tp (gpt.norm). recompute_up (Megatron's
    --recompute-modules mla_up_proj): the up-projections and the rotation run again in backward,
    which keeps the latents instead of q, k and v."""
    mla = config.attention.mla
    if "q" in p:
        q_in, q_weight = x_BSH, p["q"]["weight"]
    else:
        q_in = ops.linear(x_BSH, replicated_param(p["q_down"]["weight"], tp))
        if "q_latent_norm" in p:
            q_in = norm(p["q_latent_norm"], q_in)
        q_weight = p["q_up"]["weight"]
    latent, k_rot = ops.linear(x_BSH, replicated_param(p["kv_down"]["weight"], tp)).split(
        [mla.kv_lora_rank, mla.qk_pos_emb_head_dim], dim=-1
    )
    if "kv_latent_norm" in p:
        latent = norm(p["kv_latent_norm"], latent)

    def up(q_in, latent, k_rot, q_weight, kv_weight):
        return _up_and_rotate(q_in, latent, k_rot, q_weight, kv_weight, config, rope, tp)

    args = (q_in, latent, k_rot, q_weight, p["kv_up"]["weight"])
    return ops.recomputed(up, *args) if recompute_up else up(*args)


def _up_and_rotate(
    q_in: torch.Tensor,
    latent: torch.Tensor,
    k_rot: torch.Tensor,
    q_weight: torch.Tensor,
    kv_weight: torch.Tensor,
    config,
    rope: tuple | None,
    tp: TensorParallel,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heads' q, k and v from the query input (the hidden states or the normed q latent), the
    normed kv latent and the shared rotary key part: the column-parallel up-projections, then
    RoPE."""
    c = config
    mla = c.attention.mla
    q = column_parallel_linear(q_in, q_weight, None, tp, site="q_up")
    kv = column_parallel_linear(latent, kv_weight, None, tp, site="kv_up")
    q = rearrange(q, "b s (n d) -> b n s d", d=q_head_dim(c))
    kv = rearrange(kv, "b s (n d) -> b n s d", d=mla.qk_head_dim + mla.v_head_dim)
    k_plain, v = kv.split([mla.qk_head_dim, mla.v_head_dim], dim=-1)
    q_plain, q_rot = q.split([mla.qk_head_dim, mla.qk_pos_emb_head_dim], dim=-1)
    # every head of this rank uses it
    k_rot = rearrange(enter(k_rot, tp), "b s d -> b 1 s d")
    if rope is not None:
        q_rot, k_rot = (
            ops.apply_rope(_deinterleave(q_rot), *rope),
            ops.apply_rope(_deinterleave(k_rot), *rope),
        )
    q = torch.cat([q_plain, q_rot], dim=-1)
    k = torch.cat([k_plain, k_rot.expand(-1, q.shape[1], -1, -1)], dim=-1)
    factor = softmax_factor(c)
    return (q * factor if factor != 1.0 else q), k, v


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Dimensions (0, 2, 4, ..., 1, 3, 5, ...): megatron-core's MLA rotates pairs (2i, 2i + 1) this
    way."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
