"""fmeg's GPT parameters as megatron-core's GPTModel names them in a distributed checkpoint.

    # Source(("decoder.layers.mlp.linear_fc1.weight",), layer=3, split=0)
    src = source("layers.3.mlp.fc1.weight")
    # where that box lies in Megatron's tensor
    boxes(src, Box((0, 0, 0), (2, 96, 64)), megatron_rows)

megatron-core stacks a decoder's layers into one global tensor per name (its leading dimension
counts the layers of the whole model, over every pipeline stage) and its experts behind that
([layers, experts, ...]). Its gated MLP input projection is one [2F, H] matrix (gate rows, then up
rows, whatever its tensor parallelism: the shards are cut from each half), where fmeg keeps [2, F,
H]: `split` names the fmeg dimension whose pair (split, split + 1) is Megatron's one. Q, K and V are
fused per query group in both, so attention weights are the same tensor. Some tensors have had two
names (the layer norms fused into the next linear by Transformer Engine's layer spec, or separate in
the local one): the first name the checkpoint holds is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fmeg.checkpoint.boxes import Box


@dataclass(frozen=True)
class Source:
    # Megatron's names for the tensor, the usual one first
    keys: tuple[str, ...]
    # the index in Megatron's stacked layers dimension
    layer: int | None = None
    # fmeg's dims (split, split + 1) are Megatron's dim split (fc1's [2, F] as [2F])
    split: int | None = None


_TOP = {
    "embedding.word.weight": "embedding.word_embeddings.weight",
    "embedding.position.weight": "embedding.position_embeddings.weight",
    "final_norm.weight": "decoder.final_layernorm.weight",
    "final_norm.bias": "decoder.final_layernorm.bias",
    "output.weight": "output_layer.weight",
}
_D = "decoder.layers."
# fmeg's path inside layers.{i} -> Megatron's names, and the split dim of a gated fc1
_LAYER = {
    "attn_norm.weight": (
        (f"{_D}self_attention.linear_qkv.layer_norm_weight", f"{_D}input_layernorm.weight"),
        None,
    ),
    "attn_norm.bias": (
        (f"{_D}self_attention.linear_qkv.layer_norm_bias", f"{_D}input_layernorm.bias"),
        None,
    ),
    "attn.qkv.weight": ((f"{_D}self_attention.linear_qkv.weight",), None),
    "attn.qkv.bias": ((f"{_D}self_attention.linear_qkv.bias",), None),
    "attn.proj.weight": ((f"{_D}self_attention.linear_proj.weight",), None),
    "attn.proj.bias": ((f"{_D}self_attention.linear_proj.bias",), None),
    "attn.q_norm.weight": ((f"{_D}self_attention.q_layernorm.weight",), None),
    "attn.k_norm.weight": ((f"{_D}self_attention.k_layernorm.weight",), None),
    "mlp_norm.weight": (
        (f"{_D}mlp.linear_fc1.layer_norm_weight", f"{_D}pre_mlp_layernorm.weight"),
        None,
    ),
    "mlp_norm.bias": ((f"{_D}mlp.linear_fc1.layer_norm_bias", f"{_D}pre_mlp_layernorm.bias"), None),
    "mlp.fc1.weight": ((f"{_D}mlp.linear_fc1.weight",), 0),
    "mlp.fc1.bias": ((f"{_D}mlp.linear_fc1.bias",), 0),
    "mlp.fc2.weight": ((f"{_D}mlp.linear_fc2.weight",), None),
    "mlp.fc2.bias": ((f"{_D}mlp.linear_fc2.bias",), None),
    "mlp.router.weight": ((f"{_D}mlp.router.weight",), None),
    "mlp.router.bias": ((f"{_D}mlp.router.bias",), None),
    "mlp.router.expert_bias": ((f"{_D}mlp.router.expert_bias",), None),
    "mlp.experts.fc1.weight": ((f"{_D}mlp.experts.experts.linear_fc1.weight",), 1),
    "mlp.experts.fc1.bias": ((f"{_D}mlp.experts.experts.linear_fc1.bias",), 1),
    "mlp.experts.fc2.weight": ((f"{_D}mlp.experts.experts.linear_fc2.weight",), None),
    "mlp.experts.fc2.bias": ((f"{_D}mlp.experts.experts.linear_fc2.bias",), None),
    "mlp.shared.fc1.weight": ((f"{_D}mlp.shared_experts.linear_fc1.weight",), 0),
    "mlp.shared.fc1.bias": ((f"{_D}mlp.shared_experts.linear_fc1.bias",), 0),
    "mlp.shared.fc2.weight": ((f"{_D}mlp.shared_experts.linear_fc2.weight",), None),
    "mlp.shared.fc2.bias": ((f"{_D}mlp.shared_experts.linear_fc2.bias",), None),
    "mlp.shared_gate.weight": ((f"{_D}mlp.shared_experts.gate_weight",), None),
}
_LAYER_PATH = re.compile(r"layers\.(\d+)\.(.+)")


def source(path: str, gated: bool) -> Source | None:
    """Where fmeg's global tensor `path` is in a Megatron checkpoint (None: Megatron has no such
    tensor). gated: the MLPs are SwiGLU (fc1 holds gate and up)."""
    if path in _TOP:
        return Source((_TOP[path],))
    m = _LAYER_PATH.fullmatch(path)
    if not m or m.group(2) not in _LAYER:
        return None
    keys, split = _LAYER[m.group(2)]
    return Source(keys, int(m.group(1)), split if gated else None)


def megatron_shape(src: Source, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one layer's slice of Megatron's tensor for fmeg's global shape."""
    if src.split is None:
        return shape
    d = src.split
    return (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2 :])


def boxes(src: Source, box: Box, shape: tuple[int, ...]) -> list[tuple[Box, tuple]]:
    """fmeg's box of a global tensor of `shape` as boxes of Megatron's stacked tensor, each with the
    index of the part of fmeg's box it fills (a view of the request's tensor, reshaped to the
    Megatron box)."""
    lead = () if src.layer is None else (src.layer,)
    if src.split is None:
        return [(Box((*lead, *box.offset), (*(1,) * len(lead), *box.shape)), ())]
    d, rows = src.split, shape[src.split + 1]
    out = []
    # gate, then up: each a run of Megatron's 2F rows
    for a in range(box.offset[d], box.end[d]):
        offset = (*box.offset[:d], a * rows + box.offset[d + 1], *box.offset[d + 2 :])
        size = (*box.shape[:d], box.shape[d + 1], *box.shape[d + 2 :])
        out.append(
            (
                Box((*lead, *offset), (*(1,) * len(lead), *size)),
                (slice(None),) * d + (a - box.offset[d],),
            )
        )
    return out
