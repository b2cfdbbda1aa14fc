"""The key/value cache: one k and one v tensor per layer, [batch, kv_heads, capacity, head_dim].

    cache = new_cache(stage_params, config, batch=2, capacity=96, pad=torch.tensor([3, 0]))

Rows are left-padded: row b's tokens occupy slots pad[b] .. length - 1, so every row writes the same
slot at each step and a decode step is one batched matmul. A slot below pad[b] is never attended to,
and row b's position ids start at 0 at slot pad[b], so each row computes what it would alone.

Sharding contract: a cache holds the key/value heads of the parameters it was made from. On a
tensor- parallel rank that is its own G/t groups (the qkv weight's rows say how many); on a pipeline
stage, only that stage's layers.

The tensors are allocated once. A forward step writes its new keys and values into them and returns
a cache with the larger length: the cache passed in is consumed (JAX would say donated) and must not
be used again; everything else about the step is a pure function.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fmeg.models.gpt import GPTConfig, Params


@dataclass(frozen=True)
class KVCache:
    # per layer [batch, kv_heads_here, capacity, head_dim]
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    # [batch] int64: left-padding slots of each row
    pad: torch.Tensor
    # slots filled so far (padding included)
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    def advanced(self, steps: int) -> "KVCache":
        return dataclasses.replace(self, length=self.length + steps)


def local_kv_heads(layer_params: Params, config: GPTConfig) -> int:
    """How many key/value heads these (possibly tensor-parallel) layer parameters hold."""
    attn = layer_params["attn"]
    # multi-latent attention: one key and value per query head
    if "kv_up" in attn:
        return attn["kv_up"]["weight"].shape[0] // (
            config.attention.mla.qk_head_dim + config.attention.mla.v_head_dim
        )
    return attn["qkv"]["weight"].shape[0] // ((config.heads_per_group + 2) * config.head_dim)


def head_dims(config: GPTConfig) -> tuple[int, int]:
    """The cached keys' and values' head dimensions: multi-latent attention caches the expanded keys
    (its nope and rotary parts) and values, not its latent."""
    if config.attention.mla is not None:
        return (
            config.attention.mla.qk_head_dim + config.attention.mla.qk_pos_emb_head_dim,
            config.attention.mla.v_head_dim,
        )
    return config.head_dim, config.head_dim


def new_cache(
    stage_params: Params,
    config: GPTConfig,
    *,
    batch: int,
    capacity: int,
    pad: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> KVCache:
    """An empty cache for the layers in stage_params (a whole model, a shard, or one pipeline
    stage)."""
    if capacity > config.max_seq_len:
        raise ValueError(
            f"a cache of {capacity} positions exceeds GPTConfig.max_seq_len={config.max_seq_len}"
        )
    layers = stage_params["layers"]
    like = layers[0]["attn"]["proj"]["weight"] if layers else torch.empty(0)
    dtype = dtype or like.dtype
    heads, (k_dim, v_dim) = local_kv_heads(layers[0], config) if layers else 0, head_dims(config)
    ks = tuple(
        torch.zeros((batch, heads, capacity, k_dim), dtype=dtype, device=like.device)
        for _ in layers
    )
    vs = tuple(
        torch.zeros((batch, heads, capacity, v_dim), dtype=dtype, device=like.device)
        for _ in layers
    )
    pad = torch.zeros(batch, dtype=torch.int64) if pad is None else pad.to(torch.int64)
    return KVCache(ks, vs, pad.to(like.device))


def _flatten(cache: KVCache):
    return [list(cache.k), list(cache.v), cache.pad], cache.length


def _unflatten(children, length: int) -> KVCache:
    k, v, pad = children
    return KVCache(tuple(k), tuple(v), pad, length)


torch.utils._pytree.register_pytree_node(
    KVCache, _flatten, _unflatten, serialized_type_name="fmeg.KVCache"
)
