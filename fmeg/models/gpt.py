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

The qkv rows are grouped per key/value head (fmeg.models.self_attention), so a contiguous slice of
rows is a whole set of groups, as tensor parallelism needs; apply reads head counts from the
weights' shapes, so it runs unchanged on a shard. This file composes the layer, the embedding and
the loss; init draws in fmeg.models.gpt_init, attention in self_attention, norms in norms.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fmeg import ops
from fmeg.models import mla, moe
from fmeg.models.mlp import dense_mlp
from fmeg.models.self_attention import attention, rope_tables

# part of gpt's interface: re-exported (the "X as X" form says so)
from fmeg.models.config_rules import ACTIVATIONS as ACTIVATIONS
from fmeg.models.config_rules import GATED as GATED
from fmeg.models.config_rules import NORMS as NORMS
from fmeg.models.config_rules import POSITIONS as POSITIONS
from fmeg.models.gpt_config import GPTConfig as GPTConfig
from fmeg.models.gpt_init import init as init
from fmeg.models.gpt_init import init_layer as init_layer
from fmeg.models.gpt_init import init_mtp_layer as init_mtp_layer
from fmeg.models.norms import norm as norm
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
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)

Params = dict[str, Any]


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
    logits = column_parallel_linear(x, weight, None, tp, vocab=True)
    return mask_vocab_padding(logits, config.vocab_size, tp)


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
    # --deterministic-mode's one rank takes tp's path: the same pieces, so the same bits
    if tp.group is None and not tp.exact:
        return ops.linear_cross_entropy(
            x,
            weight,
            labels,
            loss_mask=loss_mask,
            vocab_size=vocab_size,
            label_smoothing=label_smoothing,
            reduction=reduction,
        )
    logits = column_parallel_linear(x, weight, None, tp, vocab=True)
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
