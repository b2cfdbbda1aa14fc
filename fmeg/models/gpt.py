"""A GPT as pure functions over a parameter pytree.

    params = init(config, seed)                      # nested dicts and lists of tensors
    logits = apply(params, tokens, config)           # [batch, seq, vocab]
    value  = loss(params, batch, config)             # scalar, differentiable with torch.func

Parameter paths (leaves present depending on config):

    embedding.word.weight          [Vp, H]
        Vp = padded_vocab_size >= V = vocab_size
    embedding.position.weight      [S, H]                          position == "learned"
    layers.{i}.attn_norm.{weight,bias}                             bias for layernorm only
    layers.{i}.attn.qkv.{weight,bias}   [G * (N/G + 2) * D, H]     Megatron's grouped q-k-v order
    layers.{i}.attn.proj.{weight,bias}  [H, N * D]
    layers.{i}.mlp_norm.{weight,bias}
    layers.{i}.attn.sinks               [N]                        softmax_type "learnable"
    layers.{i}.mlp.fc1.{weight,bias}    [F, H], or [2, F, H] (gate, up) for swiglu and quick_geglu
    layers.{i}.mlp.fc2.{weight,bias}    [H, F]
    final_norm.{weight,bias}
    output.weight                  [Vp, H]                         unless tie_embeddings

Vocabulary padding is inert: rows V..Vp-1 of the tables are zero at init, never take part in a
softmax and get no gradient, so the padding (Megatron's depends on tp) changes no number.
`repad_vocab` moves a tree from one padding to another.

The qkv rows are grouped per key/value head g: its N/G query heads, then its key, then its value. A
contiguous slice of rows is then a whole set of groups, which is what tensor parallelism needs; for
the same reason apply reads head counts from the weights' shapes, so it runs unchanged on a shard.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from typing import Any

import torch
from einops import rearrange

from fmeg import ops
from fmeg.models import mla, moe
from fmeg.models.mlp import dense_mlp

# part of gpt's interface: re-exported (the "X as X" form says so)
from fmeg.models.config_rules import ACTIVATIONS as ACTIVATIONS
from fmeg.models.config_rules import GATED as GATED
from fmeg.models.config_rules import NORMS as NORMS
from fmeg.models.config_rules import POSITIONS as POSITIONS
from fmeg.models.gpt_config import GPTConfig as GPTConfig
from fmeg.models.vocab import VOCAB_TABLES as VOCAB_TABLES
from fmeg.models.vocab import pad_rows as pad_rows
from fmeg.models.vocab import repad_vocab as repad_vocab
from fmeg.parallel import collectives as C
from fmeg.parallel import context
from fmeg.parallel.sharding import Partition
from fmeg.parallel.tensor import (
    NO_TP,
    TensorParallel,
    column_parallel_linear,
    hidden_dropout,
    mask_vocab_padding,
    replicated_param,
    row_parallel_linear,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

Params = dict[str, Any]

# -------------------------------------------------------------------------------------------------
# init: every leaf drawn on CPU in fp32 from its own generator, seeded by (seed, path), so a leaf
# does not depend on which other leaves exist (a pipeline stage can build only its layers) or on the
# machine.


def leaf_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _normal(shape: tuple[int, ...], std: float, seed: int, path: str) -> torch.Tensor:
    # init's shapes only: nothing drawn
    if torch.get_default_device().type == "meta":
        return torch.empty(shape)
    gen = torch.Generator().manual_seed(leaf_seed(seed, path))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _norm_params(c: GPTConfig, size: int | None = None) -> Params:
    size = size or c.hidden_size
    p = {"weight": torch.zeros(size) if c.norm_zero_centered else torch.ones(size)}
    if c.norm == "layernorm":
        p["bias"] = torch.zeros(size)
    return p


def _linear_params(shape: tuple[int, ...], std: float, bias: bool, seed: int, path: str) -> Params:
    p = {"weight": _normal(shape, std, seed, f"{path}.weight")}
    if bias:
        p["bias"] = torch.zeros(shape[:-1])
    return p


def init_layer(config: GPTConfig, seed: int, index: int) -> Params:
    """Parameters of layer `index`; output projections get Megatron's std / sqrt(2 * num_layers)."""
    c, at = config, f"layers.{index}"
    std, out_std = c.init_std, c.init_std / math.sqrt(2.0 * c.num_layers)
    qkv_rows = c.num_kv_heads * (c.heads_per_group + 2) * c.head_dim
    fc1_shape = (
        (2, c.ffn_hidden_size, c.hidden_size)
        if c.activation in GATED
        else (c.ffn_hidden_size, c.hidden_size)
    )
    if c.attention.mla is not None:
        attn = mla.init_attention(c, seed, f"{at}.attn", _normal, _linear_params, _norm_params)
    else:
        attn = {
            "qkv": _linear_params(
                (qkv_rows, c.hidden_size),
                std,
                c.bias or c.attention.qkv_bias,
                seed,
                f"{at}.attn.qkv",
            ),
            "proj": _linear_params(
                (c.hidden_size, c.num_heads * c.head_dim), out_std, c.bias, seed, f"{at}.attn.proj"
            ),
        }
    # drawn as megatron-core draws its softmax_offset: the weights' init method
    if c.attention.softmax_type == "learnable":
        attn["sinks"] = _normal((c.num_heads,), std, seed, f"{at}.attn.sinks")
    # over each head's dimensions, shared by every head
    if c.attention.qk_norm and c.attention.mla is None:
        attn |= {"q_norm": _norm_params(c, c.head_dim), "k_norm": _norm_params(c, c.head_dim)}
    if moe.moe_layers(c, mtp=True)[index]:
        mlp_params = moe.init_moe(c, seed, f"{at}.mlp", _normal, _linear_params)
    else:
        mlp_params = {
            "fc1": _linear_params(fc1_shape, std, c.bias, seed, f"{at}.mlp.fc1"),
            "fc2": _linear_params(
                (c.hidden_size, c.ffn_hidden_size), out_std, c.bias, seed, f"{at}.mlp.fc2"
            ),
        }
    return {
        "attn_norm": _norm_params(c),
        "attn": attn,
        "mlp_norm": _norm_params(c),
        "mlp": mlp_params,
    }


def init_mtp_layer(config: GPTConfig, seed: int, k: int) -> Params:
    """Multi-token prediction depth k + 1's parameters (fmeg.models.mtp): its norms, eh_proj [H, 2H]
    (drawn as megatron-core draws it, std init_std) and a decoder layer numbered num_layers + k, of
    the last layer's kind."""
    c, at = config, f"mtp.{k}"
    return {
        "enorm": _norm_params(c),
        "hnorm": _norm_params(c),
        "eh_proj": _linear_params(
            (c.hidden_size, 2 * c.hidden_size), c.init_std, False, seed, f"{at}.eh_proj"
        ),
        "layer": init_layer(c, seed, c.num_layers + k),
        "final_norm": _norm_params(c),
    }


def _vocab_table(c: GPTConfig, seed: int, path: str) -> torch.Tensor:
    """The real rows drawn as for an unpadded table, then zero padding rows."""
    return pad_rows(
        _normal((c.vocab_size, c.hidden_size), c.init_std, seed, path), c.padded_vocab_size
    )


def init(
    config: GPTConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    only: str | None = None,
) -> Params:
    """Full (unsharded) parameters; bitwise the same for the same config and seed on any machine,
    and the same real vocabulary rows whatever the padding. Under torch.device("meta") with
    device="meta": the shapes alone, nothing drawn or stored. only: one unit ("embedding",
    "layers.3", "final_norm", "output", "mtp") drawn, the others meta tensors (the model built a
    unit at a time)."""
    c = config

    def unit(name: str) -> Any:
        return torch.device("meta") if only not in (None, name) else contextlib.nullcontext()

    with unit("embedding"):
        params: Params = {
            "embedding": {"word": {"weight": _vocab_table(c, seed, "embedding.word.weight")}}
        }
        if c.position == "learned":
            params["embedding"]["position"] = {
                "weight": _normal(
                    (c.max_seq_len, c.hidden_size), c.init_std, seed, "embedding.position.weight"
                )
            }
    params["layers"] = []
    for i in range(c.num_layers):
        with unit(f"layers.{i}"):
            params["layers"].append(init_layer(c, seed, i))
    with unit("final_norm"):
        params["final_norm"] = _norm_params(c)
    if c.mtp_depth:
        with unit("mtp"):
            params["mtp"] = [init_mtp_layer(c, seed, k) for k in range(c.mtp_depth)]
    if not c.tie_embeddings:
        with unit("output"):
            params["output"] = {"weight": _vocab_table(c, seed, "output.weight")}
    return torch.utils._pytree.tree_map(
        lambda t: t if t.is_meta else t.to(device=device, dtype=dtype), params
    )


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


# ------------------------------------------------------------------------------------------------
# apply


def norm(p: Params, x: torch.Tensor, config: GPTConfig, tp: TensorParallel = NO_TP) -> torch.Tensor:
    weight, bias = replicated_param(p["weight"], tp), replicated_param(p.get("bias"), tp)
    if config.norm_zero_centered:
        weight = weight + 1.0
    if config.norm == "rmsnorm":
        return ops.rms_norm(x, weight, config.norm_eps)
    return ops.layer_norm(x, weight, bias, config.norm_eps)


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


def head_norm(
    p: Params, x_BNSD: torch.Tensor, config: GPTConfig, tp: TensorParallel = NO_TP
) -> torch.Tensor:
    """The norm over each head's dimensions. Its weight is replicated while the heads are split over
    tp, so each rank's gradient covers its own heads only: copy_to sums them over tp in backward."""
    weight, bias = p["weight"], p.get("bias")
    if tp.size > 1:
        weight, bias = (
            C.copy_to(weight, tp.group),
            None if bias is None else C.copy_to(bias, tp.group),
        )
    if config.norm_zero_centered:
        weight = weight + 1.0
    if config.norm == "rmsnorm":
        return ops.rms_norm(x_BNSD, weight, config.norm_eps)
    return ops.layer_norm(x_BNSD, weight, bias, config.norm_eps)


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


def mlp(
    p: Params,
    x_BSH: torch.Tensor,
    config: GPTConfig,
    tp: TensorParallel = NO_TP,
    aux: moe.AuxLosses = moe.NO_AUX,
    index: int = 0,
    recompute: frozenset[str] = frozenset(),
) -> torch.Tensor:
    """The layer's MLP: dense, or a mixture of experts where p has a router (fmeg.models.moe).
    recompute: "mlp" recomputes a dense MLP in backward; a mixture's are moe.moe_mlp's (Megatron's
    --recompute-modules)."""
    activation = functools.partial(
        ops.mlp_activation,
        activation=config.activation,
        glu_linear_offset=config.mlp.glu_linear_offset,
        clamp=config.mlp.clamp,
    )
    if "router" in p:
        return moe.moe_mlp(
            p, x_BSH, config, tp, activation=activation, aux=aux, index=index, recompute=recompute
        )
    if "mlp" in recompute:
        return ops.recomputed_with(lambda p, x: dense_mlp(p, x, activation, tp), p, x_BSH)
    return dense_mlp(p, x_BSH, activation, tp)


def _dropout(
    x: torch.Tensor, config: GPTConfig, key: Any, tp: TensorParallel, *site: int
) -> torch.Tensor:
    """Hidden dropout keyed by (key, site), each element by its place in the whole [b, s, h]
    (hidden_dropout)."""
    return (
        x if key is None else hidden_dropout(x, config.hidden_dropout, ops.fold_in(key, *site), tp)
    )


def layer(
    p: Params,
    x_BSH: torch.Tensor,
    config: GPTConfig,
    *,
    rope: tuple | None = None,
    key: Any = None,
    index: int = 0,
    tp: TensorParallel = NO_TP,
    recompute: frozenset[str] = frozenset(),
    aux: moe.AuxLosses = moe.NO_AUX,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """One pre-norm transformer layer: x + attn(norm(x)), then + mlp(norm(.)), hidden dropout on
    both and attention dropout inside attention (keys: fold_in(key, index, site), sites 0, 1 hidden
    and 2 attention). recompute: the Megatron --recompute-modules recomputed in backward
    (SELECTIVE_MODULES; "layernorm": the two norms)."""

    def normed(q: Params, x: torch.Tensor) -> torch.Tensor:
        if "layernorm" in recompute:
            return ops.recomputed_with(lambda q, x: norm(q, x, config, tp), q, x)
        return norm(q, x, config, tp)

    attn_key = (
        None if key is None or config.attention.dropout == 0.0 else ops.fold_in(key, index, 2)
    )
    tp = tp.for_layer(index)
    attn = attention(
        p["attn"],
        normed(p["attn_norm"], x_BSH),
        config,
        rope,
        tp,
        attn_key,
        recompute,
        documents,
        config.layer_window(index),
    )
    x_BSH = x_BSH + _dropout(attn, config, key, tp, index, 0)
    out = mlp(p["mlp"], normed(p["mlp_norm"], x_BSH), config, tp, aux, index, recompute)
    return x_BSH + _dropout(out, config, key, tp, index, 1)


def embed(
    params: Params,
    tokens: torch.Tensor,
    config: GPTConfig,
    positions: torch.Tensor,
    tp: TensorParallel = NO_TP,
) -> torch.Tensor:
    """Word (+ learned position) embeddings; [b, s/t, h] under sequence parallelism."""
    x = vocab_parallel_embedding(tokens, params["embedding"]["word"]["weight"], tp)
    if config.position == "learned":
        if tp.sp:
            positions = positions.chunk(tp.size, dim=-1)[tp.rank]
        x = x + ops.embedding(
            positions, replicated_param(params["embedding"]["position"]["weight"], tp)
        )
    return x


def output_weight(params: Params, config: GPTConfig) -> torch.Tensor:
    return (
        params["embedding"]["word"]["weight"]
        if config.tie_embeddings
        else params["output"]["weight"]
    )


def hidden_states(
    params: Params,
    tokens: torch.Tensor,
    config: GPTConfig,
    *,
    positions: torch.Tensor | None = None,
    key: Any = None,
    tp: TensorParallel = NO_TP,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The final-normed hidden states [batch, seq, hidden] ([b, s/t, h] with sequence
    parallelism)."""
    return decoder_span(
        params, tokens, None, config, positions=positions, key=key, tp=tp, documents=documents
    )


def decoder_span(
    params: Params,
    tokens: torch.Tensor,
    x: torch.Tensor | None,
    config: GPTConfig,
    *,
    first_layer: int = 0,
    final: bool = True,
    positions: torch.Tensor | None = None,
    key: Any = None,
    tp: TensorParallel = NO_TP,
    recompute: frozenset[str] = frozenset(),
    aux: moe.AuxLosses = moe.NO_AUX,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """A contiguous piece of the decoder: the embeddings when x is None, then params["layers"]
    (global layer numbers from first_layer, which key their dropout), then the final norm when
    final. The whole model is one span; a pipeline stage is one span. recompute: the modules
    selective recomputation recomputes (layer). positions: [s] or [b, s] (this rank's tokens'; reset
    per document with --reset-position-ids); documents: host cu_seqlens [b, s + 1] of the whole
    sequence, each packed document attending to itself only."""
    # the whole sequence; this rank holds its context-parallel chunks
    seq = tokens.shape[-1] * tp.context.size
    if seq > config.max_seq_len:
        raise ValueError(
            f"sequence length {seq} exceeds GPTConfig.max_seq_len={config.max_seq_len}"
        )
    if tp.size > 1:
        # a split query group would otherwise go unnoticed
        check_tensor_parallel(config, tp.size)
    if tp.sp and seq % tp.size:
        raise ValueError(
            f"sequence length {seq} must be divisible by tp={tp.size} with sequence parallelism"
        )
    if positions is None:
        positions = context.positions(seq, tp.context.size, tp.context.rank, tokens.device)
    rope = layer_rope(tokens, config, positions, tp)
    if x is None:
        x = _dropout(embed(params, tokens, config, positions, tp), config, key, tp, -1, 0)
    for i, p in enumerate(params["layers"]):
        x = layer(
            p,
            x,
            config,
            rope=rope,
            key=key,
            index=first_layer + i,
            tp=tp,
            recompute=recompute,
            aux=aux,
            documents=documents,
        )
    return norm(params["final_norm"], x, config, tp) if final else x


def layer_rope(
    tokens: torch.Tensor,
    config: GPTConfig,
    positions: torch.Tensor | None,
    tp: TensorParallel = NO_TP,
) -> tuple | None:
    """The layers' RoPE tables for this rank's tokens (positions: theirs, or None for 0..s-1 of the
    whole sequence), [b, 1, s, d] for per-row positions; None with learned positions."""
    if config.position != "rope":
        return None
    if positions is None:
        seq = tokens.shape[-1] * tp.context.size
        positions = context.positions(seq, tp.context.size, tp.context.rank, tokens.device)
    rope = rope_tables(positions, config)
    # [b, 1, s, d]: each row's own, broadcast over heads
    if positions.dim() == 2:
        rope = (rope[0][:, None], rope[1][:, None])
    return rope


def apply(
    params: Params,
    tokens: torch.Tensor,
    config: GPTConfig,
    *,
    positions: torch.Tensor | None = None,
    key: Any = None,
    tp: TensorParallel = NO_TP,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits [batch, seq, vocab_size] for tokens [batch, seq]; under tensor parallelism this rank's
    shard of the padded vocabulary [batch, seq, padded_vocab_size/t] with -inf at padding ids
    (gather with collectives.gather_from, then [..., :vocab_size]). A key turns dropout on (hidden
    and attention)."""
    x = hidden_states(
        params, tokens, config, positions=positions, key=key, tp=tp, documents=documents
    )
    weight = output_weight(params, config)
    if tp.group is None:
        return ops.linear(x, weight[: config.vocab_size])
    return mask_vocab_padding(column_parallel_linear(x, weight, None, tp), config.vocab_size, tp)


def loss(
    params: Params,
    batch: dict[str, torch.Tensor],
    config: GPTConfig,
    *,
    key: Any = None,
    label_smoothing: float = 0.0,
    tp: TensorParallel = NO_TP,
) -> torch.Tensor:
    """Mean cross entropy over batch["labels"] where batch.get("loss_mask", 1) is nonzero.

    The language model's loss only: with multi-token prediction layers the training objective is
    fmeg.models.mtp.loss. Equal to ops.cross_entropy(apply(...), labels, ...). On one rank the
    output projection and the loss run as one fused op (ops.linear_cross_entropy); under tensor
    parallelism the loss is vocabulary-parallel and never gathers the logits.
    """
    x = hidden_states(
        params,
        batch["tokens"],
        config,
        key=key,
        tp=tp,
        positions=batch.get("position_ids"),
        documents=batch.get("cu_seqlens"),
    )
    return output_loss(
        x,
        output_weight(params, config),
        batch,
        config.vocab_size,
        tp=tp,
        label_smoothing=label_smoothing,
    )


def output_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    batch: dict,
    vocab_size: int,
    *,
    tp: TensorParallel = NO_TP,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Mean cross entropy of the output layer over the first vocab_size ids (padding rows of weight
    take no part and get no gradient): fused on one rank, vocabulary-parallel under TP. reduction
    "sum": the sum over counted tokens (loss_tokens gives their number)."""
    # over every cp rank's tokens: the ranks' losses sum to it
    if tp.context.size > 1 and reduction == "mean":
        total = output_loss(
            x, weight, batch, vocab_size, tp=tp, label_smoothing=label_smoothing, reduction="sum"
        )
        return total / C.all_reduce_constant(
            loss_tokens(batch).to(total.device), tp.context.group
        ).clamp_min(1.0)
    labels, loss_mask = batch["labels"], batch.get("loss_mask")
    if tp.group is None:
        return ops.linear_cross_entropy(
            x,
            weight,
            labels,
            loss_mask=loss_mask,
            vocab_size=vocab_size,
            label_smoothing=label_smoothing,
            reduction=reduction,
        )
    logits = column_parallel_linear(x, weight, None, tp)
    losses = vocab_parallel_cross_entropy(
        logits, labels, tp, label_smoothing=label_smoothing, vocab_size=vocab_size
    )
    mask = (labels != ops.IGNORE_INDEX).to(losses.dtype)
    mask = mask if loss_mask is None else mask * loss_mask.to(losses.dtype)
    return (losses * mask).sum() if reduction == "sum" else ops.masked_mean(losses, mask)


def loss_tokens(batch: dict) -> torch.Tensor:
    """The number of tokens a microbatch's loss counts (valid label, nonzero mask), as an fp32
    tensor."""
    mask = (batch["labels"] != ops.IGNORE_INDEX).float()
    return (mask if batch.get("loss_mask") is None else mask * batch["loss_mask"].float()).sum()


# Tensor-parallel partitions of every leaf (dims from the end, so SwiGLU's stacked fc1 needs no
# special case): vocabulary rows, qkv groups, MLP columns, and the input side of the row-parallel
# projections.
TP_RULES = (
    (
        ("embedding.word.weight", Partition(-2)),
        ("output.weight", Partition(-2)),
        ("mtp_embedding.weight", Partition(-2)),
        ("layers.*.attn.qkv.weight", Partition(-2)),
        ("layers.*.attn.qkv.bias", Partition(-1)),
        ("layers.*.attn.proj.weight", Partition(-1)),
        ("layers.*.attn.sinks", Partition(-1)),
        ("layers.*.mlp.fc1.weight", Partition(-2)),
        ("layers.*.mlp.fc1.bias", Partition(-1)),
        ("layers.*.mlp.fc2.weight", Partition(-1)),
    )
    + moe.TP_RULES
    + mla.TP_RULES
)
# the multi-token prediction layers' decoder layers split as the decoder's; their eh_proj is
# column-parallel
TP_RULES += tuple(
    (f"mtp.*.layer.{p.removeprefix('layers.*.')}", part)
    for p, part in TP_RULES
    if p.startswith("layers.*.")
) + (("mtp.*.eh_proj.weight", Partition(-2)),)


def check_tensor_parallel(config: GPTConfig, tp: int) -> None:
    """Raise ValueError naming the field if the model does not split over tp ranks."""
    sizes = [
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("ffn_hidden_size", config.ffn_hidden_size),
        ("padded_vocab_size", config.padded_vocab_size),
    ]
    if config.experts:
        sizes += [
            ("moe_ffn_hidden_size", moe.expert_ffn(config)),
            (
                "moe_shared_expert_intermediate_size",
                config.experts.shared_expert_intermediate_size or tp,
            ),
        ]
    for field, value in sizes:
        if value % tp:
            hint = (
                " (Megatron pads to a multiple of 128 * tp)" if field == "padded_vocab_size" else ""
            )
            raise ValueError(
                f"GPTConfig.{field}={value} must be divisible by the tensor-parallel size "
                f"{tp}{hint}"
            )
