"""A GPT's parameters drawn: init(config, seed) -> a nested dict of full (unsharded) tensors.

Every leaf is drawn on CPU in fp32 from its own generator, seeded by (seed, path), so a leaf does
not depend on which other leaves exist (a pipeline stage can build only its layers) or on the
machine. fmeg.models.gpt documents the parameter paths and re-exports init.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from typing import Any

import torch

from fmeg.models import mla, moe
from fmeg.models.config_rules import GATED
from fmeg.models.gpt_config import GPTConfig
from fmeg.models.vocab import pad_rows

Params = dict[str, Any]


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
