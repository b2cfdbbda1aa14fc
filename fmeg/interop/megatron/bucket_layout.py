"""Where megatron-core's distributed optimizer keeps each parameter: its registration order under
the local and Transformer Engine layer specs, each rank's part of each parameter, and their
offsets in the gradient buffer's buckets.

    params = rank_params(dist, args, LAYER_ORDERS["local"], owner_of(args, None, 0, 0), False)
    placed_in(params, [(bucket key prefix, its unpadded elements), ...])   # [(key, Piece)]

megatron-core lays a buffer's parameters out in reverse registration order, each starting at a
multiple of 64 elements, a bucket closing at --ddp-bucket-size elements (with
--overlap-grad-reduce) and around a tied embedding's copy at either end of a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fmeg.checkpoint.boxes import Box
from fmeg.parallel.pipeline.stage_layers import flag_stage_layers, layout_stage_layers

_D = "decoder.layers."
# a layer's parameters: (names the checkpoint may hold, one of them; tensor-parallel split dim)
_LN1 = ((_D + "self_attention.linear_qkv.layer_norm_weight", _D + "input_layernorm.weight"), None)
_LN1_B = ((_D + "self_attention.linear_qkv.layer_norm_bias", _D + "input_layernorm.bias"), None)
_PROJ = [
    ((_D + "self_attention.linear_proj.weight",), 1),
    ((_D + "self_attention.linear_proj.bias",), None),
]
_QKV = [
    ((_D + "self_attention.linear_qkv.weight",), 0),
    ((_D + "self_attention.linear_qkv.bias",), 0),
]
_QK_NORMS = [
    ((_D + f"self_attention.{n}_layernorm.{w}",), None) for n in "qk" for w in ("weight", "bias")
]
_LN2 = ((_D + "mlp.linear_fc1.layer_norm_weight", _D + "pre_mlp_layernorm.weight"), None)
_LN2_B = ((_D + "mlp.linear_fc1.layer_norm_bias", _D + "pre_mlp_layernorm.bias"), None)
_FC1 = [((_D + "mlp.linear_fc1.weight",), 0), ((_D + "mlp.linear_fc1.bias",), 0)]
_FC2 = [((_D + "mlp.linear_fc2.weight",), 1), ((_D + "mlp.linear_fc2.bias",), None)]
# a mixture of experts' MLP: the router, each local expert (where the experts share the dense
# parameters' buffer), the shared experts
_EXPERTS = "experts"
_MOE = [
    ((_D + "mlp.router.weight",), None),
    ((_D + "mlp.router.bias",), None),
    _EXPERTS,
    ((_D + "mlp.shared_experts.linear_fc1.weight",), 0),
    ((_D + "mlp.shared_experts.linear_fc1.bias",), 0),
    ((_D + "mlp.shared_experts.linear_fc2.weight",), 1),
    ((_D + "mlp.shared_experts.linear_fc2.bias",), None),
    ((_D + "mlp.shared_experts.gate_weight",), None),
]
# one expert's parameters (SequentialMLP's local_experts.<j>), split over expert tensor ranks
_EXPERT = [
    ((_D + "mlp.experts.experts.linear_fc1.weight",), 0),
    ((_D + "mlp.experts.experts.linear_fc1.bias",), 0),
    ((_D + "mlp.experts.experts.linear_fc2.weight",), 1),
    ((_D + "mlp.experts.experts.linear_fc2.bias",), None),
]
LAYER_ORDERS = {
    "local": [_LN1, _LN1_B, *_PROJ, *_QKV, *_QK_NORMS, _LN2, _LN2_B, *_FC1, *_FC2, *_MOE],
    "transformer_engine": [
        *_PROJ,
        _LN1,
        _LN1_B,
        *_QKV,
        *_QK_NORMS,
        _LN2,
        _LN2_B,
        *_FC1,
        *_FC2,
        *_MOE,
    ],
}
EMBEDDING = "embedding.word_embeddings.weight"
_PRE = [((EMBEDDING,), 0), (("embedding.position_embeddings.weight",), None)]
_POST = [(("decoder.final_layernorm.weight",), None), (("decoder.final_layernorm.bias",), None)]
OUTPUT = "output_layer.weight"
_GATED_FC1 = {
    _D + f"mlp.{m}linear_fc1.{w}"
    for m in ("", "experts.experts.", "shared_experts.")
    for w in ("weight", "bias")
}
# Megatron-LM's flags whose modules this reader does not place
UNPLACED_FLAGS = ("mtp_num_layers",)


class Unplaced(ValueError):
    """The state's parameters cannot be placed; the message says why, in a few words."""


@dataclass(frozen=True)
class Owner:
    """Whose buffer: tensor rank t of tp (for an experts' buffer, of the experts' tp), expert
    rank e of ep, pipeline rank p's model chunk; whether it holds the experts only (the expert
    optimizer's), and whether the experts are apart from the dense parameters."""

    t: int
    tp: int
    e: int
    ep: int
    p: int
    chunk: int
    experts_only: bool = False
    experts_apart: bool = False


@dataclass(frozen=True)
class Piece:
    """Part of a rank's parameter: `box` of the model's global tensor, `numel` elements of the
    bucket tensors `bucket`.<state> from `start`."""

    box: Box
    bucket: str
    start: int


@dataclass(frozen=True)
class Param:
    """One model-parallel rank's parameter: its key and its boxes, in its own element order."""

    key: str
    boxes: tuple[Box, ...]
    # a tied embedding's copy at either end of a pipeline: a bucket of its own
    shared: bool = False

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.boxes)


def owner_of(args: Any, optimizer: int | None, domain: int, chunk: int) -> Owner:
    """Whose buffer (dp_group_idx_<domain>, gbuf_idx_<chunk>) is: a chained optimizer's second
    (chained_1) is the experts', its domain the rank among the experts' tp x ep x pp ranks;
    otherwise the domain is the rank among tp x pp."""
    get = lambda name, default=1: int(getattr(args, name, None) or default)  # noqa: E731
    tp, pp, vp = (
        get("tensor_model_parallel_size"),
        get("pipeline_model_parallel_size"),
        get("virtual_pipeline_model_parallel_size"),
    )
    ep, etp = get("expert_model_parallel_size"), get("expert_tensor_parallel_size", tp)
    apart = bool(getattr(args, "num_experts", None)) and (ep > 1 or etp != tp)
    if optimizer == 1:
        owner = Owner(domain % etp, etp, domain // etp % ep, ep, domain // (etp * ep), chunk, True)
    elif optimizer in (None, 0):
        owner = Owner(domain % tp, tp, 0, ep, domain // tp, chunk, False, apart)
    else:
        raise Unplaced(f"it holds buckets of a chained optimizer's chained_{optimizer}")
    if owner.p >= pp or chunk >= vp:
        raise Unplaced(f"it holds buckets of dp_group_idx_{domain}, gbuf_idx_{chunk}")
    return owner


def _layers(args: Any, p: int, chunk: int) -> range:
    """The global layer indices of pipeline rank p's model chunk, as Megatron splits them: its
    layout string, its uneven-split flags, or evenly."""
    layers = int(args.num_layers)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    get = lambda name: getattr(args, name, None)  # noqa: E731
    try:
        if isinstance(layout, str) and layout:
            counts = layout_stage_layers(layout, layers, 0, pp)
        else:
            counts = flag_stage_layers(
                layers,
                pp,
                vp,
                get("decoder_first_pipeline_num_layers"),
                get("decoder_last_pipeline_num_layers"),
                bool(get("account_for_embedding_in_pipeline_split")),
                bool(get("account_for_loss_in_pipeline_split")),
            )
    except ValueError as e:
        raise Unplaced(f"its layers' pipeline split is not read ({e})") from None
    if layout is not None and not isinstance(layout, str):
        raise Unplaced("its --pipeline-model-parallel-layout is saved as an object")
    if len(counts) != pp * vp:
        raise Unplaced(f"its {len(counts)} pipeline stages are not pp {pp} x vp {vp}")
    # forward order: every rank's first virtual stage, then their second...
    stage = chunk * pp + p
    first = sum(counts[:stage])
    return range(first, first + counts[stage])


def rank_params(dist: Any, args: Any, order: list, owner: Owner, gated: bool) -> list[Param]:
    """The owner's parameters in registration order: those of `order` for each layer the chunk
    holds (a layer's experts where they share the buffer; an experts' buffer holds only them),
    the embeddings first and the final norm and output layer last where the chunk holds them;
    each the boxes of its key's global tensor it holds."""
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    first = owner.p == 0 and owner.chunk == 0 and not owner.experts_only
    last = owner.p == pp - 1 and owner.chunk == vp - 1 and not owner.experts_only
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)

    def held(names: tuple[str, ...], split: int | None, lead: tuple[int, ...]) -> Param | None:
        """The owner's part of the first of names the checkpoint holds (for these layer and
        expert indices), or None."""
        for key in names:
            if not dist.has(key):
                continue
            shape = dist.shape(key)[len(lead) :]
            whole = Box((*lead, *(0,) * len(shape)), (*(1,) * len(lead), *shape))
            if lead and not dist.covers(key, whole):
                continue
            gate = gated and key in _GATED_FC1
            return Param(key, _local_boxes(shape, split, owner.t, owner.tp, lead, gate))
        return None

    def experts(layer: int) -> list:
        count = int(getattr(args, "num_experts", None) or 0)
        local = count // owner.ep
        return [
            held(names, split, (layer, owner.e * local + j))
            for j in range(local)
            for names, split in _EXPERT
        ]

    params = []
    if first:
        params += [held(names, split, ()) for names, split in _PRE]
        if tied and pp > 1 and params[0] is not None:
            params[0] = Param(params[0].key, params[0].boxes, shared=True)
    for layer in _layers(args, owner.p, owner.chunk):
        if owner.experts_only:
            params += experts(layer)
            continue
        for entry in order:
            if entry is _EXPERTS:
                params += [] if owner.experts_apart else experts(layer)
            else:
                params.append(held(*entry, (layer,)))
    if last:
        params += [held(names, split, ()) for names, split in _POST]
        if not tied:
            params.append(held((OUTPUT,), 0, ()))
        elif pp > 1:
            # the last stage's copy of a tied embedding: a parameter of its own there
            embedding = held((EMBEDDING,), 0, ())
            params.append(embedding and Param(OUTPUT, embedding.boxes, shared=True))
    return [x for x in params if x is not None]


def _local_boxes(
    shape: tuple[int, ...], split: int | None, t: int, tp: int, lead: tuple[int, ...], gate: bool
) -> tuple[Box, ...]:
    """Rank t's boxes of a tensor of `shape` (one layer's, one expert's) split `split` over tp
    ranks: one, or a gated fc1's gate part then its up part, in its global tensor stacked over
    the layers (and experts) `lead` indexes."""
    ones = (1,) * len(lead)
    if split is None:
        return (Box((*lead, *(0,) * len(shape)), (*ones, *shape)),)
    halves = 2 if gate else 1
    part = shape[split] // halves
    if part % tp:
        raise Unplaced(f"a dimension of {shape[split]} does not split over tp {tp}")
    local = part // tp
    boxes = []
    for h in range(halves):
        offset = [0] * len(shape)
        offset[split] = h * part + t * local
        size = list(shape)
        size[split] = local
        boxes.append(Box((*lead, *offset), (*ones, *size)))
    return tuple(boxes)


def placed_in(params: list[Param], sizes: list[tuple[str, int]]) -> list | None:
    """[(model key, Piece)] of params laid out backwards from each bucket's start, each parameter
    at a multiple of 64 elements, a new bucket once the current one's elements are used; None
    where they do not fill the buckets exactly."""
    out, bucket, cursor = [], 0, 0
    for param in reversed(params):
        start = -(-cursor // 64) * 64
        if start >= sizes[bucket][1]:
            bucket, start = bucket + 1, 0
            if bucket == len(sizes):
                return None
        prefix, size = sizes[bucket]
        if start + param.numel > size:
            return None
        at = start
        for box in param.boxes:
            out.append((param.key, Piece(box, prefix, at)))
            at += box.numel
        cursor = start + param.numel
    if bucket != len(sizes) - 1 or cursor != sizes[bucket][1]:
        return None
    return out


def bucket_size_of(args: Any) -> int | None:
    """The elements at which megatron-core's DDP closes a bucket, as Megatron-LM configures it
    (none without --overlap-grad-reduce)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    if getattr(args, "ddp_bucket_size", None):
        return int(args.ddp_bucket_size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


def streamed_in(
    params: list[Param], prefix: str, total: int, bucket_size: int | None
) -> list | None:
    """As _placed, for the buckets of one buffer concatenated without their padding (a legacy
    distrib_optim.pt): they close where megatron-core's DDP closes them, at `bucket_size`
    elements and around a tied embedding's copy."""
    out, offset, cursor, count = [], 0, 0, 0
    for param in reversed(params):
        start = -(-cursor // 64) * 64
        if param.shared and count:
            offset, start, count = offset + start, 0, 0
        at = offset + start
        for box in param.boxes:
            out.append((param.key, Piece(box, prefix, at)))
            at += box.numel
        cursor, count = start + param.numel, count + 1
        if param.shared or (bucket_size is not None and cursor >= bucket_size):
            offset, cursor, count = offset + cursor, 0, 0
    return out if offset + cursor == total else None
