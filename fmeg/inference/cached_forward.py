"""The decoder over new tokens with a KV cache: prefill (many tokens) and decode (one) are the same
call.

    # one rank, whole model
    logits, cache = stage_forward(params, tokens_BS, None, cache, config)
    # pipeline stage 0
    x, cache = stage_forward(stage_params, tokens_BS, None, cache, config, final=False)
    # the last stage, a TP shard
    logits, cache = stage_forward(stage_params, tokens_BS, x, cache, config, tp=tp)

Sharding contract: params are any span of the model as gpt.decoder_span takes it (embeddings when x
is None, params["layers"], the final norm and output layer when final), whole or a tensor-parallel
shard (column/row-parallel matmuls, vocab-parallel embedding; no sequence parallelism). Activations
are [batch, new, hidden] and replicated over tp. The logits come back gathered over tp, [batch, new,
vocab_size]: padded vocabulary ids are cut off, so sampling can never produce one.

Row b's new tokens sit at cache slots cache.length .. cache.length + new - 1 and at positions
slot - cache.pad[b]; a query attends to the row's slots from pad[b] up to its own. The result equals
gpt.apply over the row's unpadded prefix at those positions (tests/inference/test_inference.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fmeg import ops
from fmeg.inference.kv_cache import KVCache
from fmeg.models import gpt, self_attention
from fmeg.models.gpt import GPTConfig, Params
from fmeg.parallel import collectives as C
from fmeg.parallel.tensor import NO_TP, TensorParallel, column_parallel_linear, mask_vocab_padding


def positions_and_mask(cache: KVCache, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [b, new] and the boolean attention mask [b, 1, new, length + new] (True:
    attend).

    A padding query (slot below pad) attends to itself only, so its row of the softmax is finite; no
    real query ever attends to a padding slot."""
    device = cache.pad.device
    slots = cache.length + torch.arange(new, device=device)
    pad = cache.pad[:, None]
    positions = (slots[None, :] - pad).clamp(min=0)
    keys = torch.arange(cache.length + new, device=device)
    causal = keys[None, None, :] <= slots[None, :, None]
    real = keys[None, None, :] >= pad[:, :, None]
    itself = keys[None, None, :] == slots[None, :, None]
    return positions, (causal & (real | itself))[:, None]


def cached_attention(
    p: Params,
    x_BSH: torch.Tensor,
    config: GPTConfig,
    rope: tuple | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    mask: torch.Tensor,
    tp: TensorParallel,
    window: int | None = None,
) -> torch.Tensor:
    """Self-attention of the new tokens over the cached ones and themselves; writes their k and v
    into the cache at slots start .. start + new - 1. window: the layer's sliding window (keys at
    most that many slots before the query); sinks (config.attention.softmax_type) in the softmax's
    denominator."""
    q, k, v = self_attention.project_qkv(p, x_BSH, config, rope, tp)
    end = start + x_BSH.shape[1]
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    if window is not None:
        slots = torch.arange(start, end, device=mask.device)[:, None]
        mask = mask & (torch.arange(end, device=mask.device) >= slots - window)
    sinks = self_attention.attention_sinks(p, config, q)
    if sinks is not None:
        out = ops.sink_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], mask, sinks=sinks)
    else:
        out = F.scaled_dot_product_attention(
            q,
            k_cache[:, :, :end],
            v_cache[:, :, :end],
            attn_mask=mask,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    return self_attention.project_out(p, out, tp)


def stage_forward(
    params: Params,
    tokens: torch.Tensor,
    x: torch.Tensor | None,
    cache: KVCache,
    config: GPTConfig,
    *,
    final: bool = True,
    tp: TensorParallel = NO_TP,
    last_only: bool = False,
    first_layer: int = 0,
) -> tuple[Any, KVCache]:
    """(logits [b, new, vocab_size] when final, else hidden states [b, new, h]; the advanced cache).

    tokens [b, new] are the new token ids (every stage needs only their shape and the cache's
    positions; stage 0 embeds them). last_only: logits for the last new position only, [b, 1,
    vocab_size]. first_layer: the global number of params["layers"][0] (a pipeline stage's; it picks
    the layers' sliding windows)."""
    if tp.sp:
        raise ValueError("generation runs without sequence parallelism")
    new = tokens.shape[1]
    if cache.length + new > cache.capacity:
        raise ValueError(
            f"the cache holds {cache.capacity} positions; {cache.length} used, {new} more asked"
        )
    positions, mask = positions_and_mask(cache, new)
    rope = None
    if config.position == "rope":
        cos, sin = self_attention.rope_tables(positions, config)
        # [b, 1, new, d]: broadcast over heads
        rope = (cos[:, None], sin[:, None])
    if x is None:
        x = gpt.embed(params, tokens, config, positions, tp)
    for i, p in enumerate(params["layers"]):
        h = gpt.norm(p["attn_norm"], x, config, tp)
        x = x + cached_attention(
            p["attn"],
            h,
            config,
            rope,
            cache.k[i],
            cache.v[i],
            cache.length,
            mask,
            tp,
            config.layer_window(first_layer + i),
        )
        x = x + gpt.mlp(p["mlp"], gpt.norm(p["mlp_norm"], x, config, tp), config, tp)
    cache = cache.advanced(new)
    if not final:
        return x, cache
    x = gpt.norm(params["final_norm"], x[:, -1:] if last_only else x, config, tp)
    weight = params["output"]["weight"] if "output" in params else gpt.output_weight(params, config)
    if tp.group is None:
        return ops.linear(x, weight[: config.vocab_size]), cache
    shard = mask_vocab_padding(column_parallel_linear(x, weight, None, tp), config.vocab_size, tp)
    return C.gather_from(shard, tp.group, -1)[..., : config.vocab_size], cache
