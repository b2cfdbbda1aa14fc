"""Megatron's distributed-optimizer state saved dp_reshardable (its default), read per parameter.

    state = BucketState.decode(TorchDistDir(path), args, gated=False)   # or Unplaced(why)
    state.shape("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight")
    state.read([("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight", box, out)])

Saved so, each model-parallel rank's state (dp_group_idx_R, R = tp rank + tp x pp rank) is one flat
tensor per gradient buffer (one per model chunk), bucket and state ("param", "exp_avg",
"exp_avg_sq"), with no names: the parameters lie as megatron-core's buffers hold them, in reverse
registration order, each starting at a multiple of 64 elements, a new bucket where the last one's
elements run out (the bucket sizes are the saved tensors' sizes). The registration order is the
layer spec's: the local spec registers a layer's input norm, then attention's output and QKV
projections, the MLP norm and the MLP's two; Transformer Engine's fuses each norm into the linear
after it, registered after attention's output projection. Each order is placed and checked against
the checkpoint's weights (the fp32 master "param" at a parameter's first row equals the model's
weight there, in the weight's dtype); the one that holds for every parameter is read, so each state
key answers as fully_reshardable's does: the parameter's global (layer-stacked) tensor by box.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from fmeg.checkpoint.boxes import Box

PREFIX = "optimizer.state."
STATES = ("param", "exp_avg", "exp_avg_sq")
_BUCKET = re.compile(
    r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
    r"\.bucket_idx_(\d+)\.(\w+)"
)
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
LAYER_ORDERS = {
    "local": [_LN1, _LN1_B, *_PROJ, *_QKV, *_QK_NORMS, _LN2, _LN2_B, *_FC1, *_FC2],
    "transformer_engine": [*_PROJ, _LN1, _LN1_B, *_QKV, *_QK_NORMS, _LN2, _LN2_B, *_FC1, *_FC2],
}
_EMBEDDING = "embedding.word_embeddings.weight"
_PRE = [((_EMBEDDING,), 0), (("embedding.position_embeddings.weight",), None)]
_POST = [(("decoder.final_layernorm.weight",), None), (("decoder.final_layernorm.bias",), None)]
_OUTPUT = "output_layer.weight"
_GATED_FC1 = {_D + "mlp.linear_fc1.weight", _D + "mlp.linear_fc1.bias"}
# Megatron-LM's flags this reader does not place the parameters of (their layer split or modules)
_UNPLACED_FLAGS = (
    "num_experts",
    "mtp_num_layers",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


class Unplaced(ValueError):
    """The state's parameters cannot be placed; the message says why, in a few words."""


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


class BucketState:
    """A TorchDistDir whose Megatron optimizer-state keys ("optimizer.state.<state>.<model key>")
    are decoded from its dp_reshardable buckets; every other key is the directory's own."""

    def __init__(self, dist: Any, pieces: dict[str, list[Piece]], shapes: dict[str, tuple]):
        self.dist, self.pieces, self.shapes = dist, pieces, shapes

    @classmethod
    def decode(cls, dist: Any, args: Any, gated: bool) -> "BucketState":
        """Place every bucket's parameters (Unplaced where they cannot be)."""
        # a legacy directory's distrib_optim.pt files: one stream per buffer, buckets unmarked
        streams = getattr(dist, "streams", None)
        buckets = streams if streams is not None else _buckets(dist)
        if not buckets:
            raise Unplaced("it holds no distributed-optimizer buckets")
        set_flags = [f for f in _UNPLACED_FLAGS if getattr(args, f, None)]
        if set_flags:
            raise Unplaced(f"its model uses --{set_flags[0].replace('_', '-')}")
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
        impl = getattr(args, "transformer_impl", "transformer_engine")
        orders = sorted(LAYER_ORDERS, key=lambda name: name != impl)
        pieces: dict[str, list[Piece]] = {}
        for (domain, chunk), sizes in sorted(buckets.items()):
            t, p = domain % tp, domain // tp
            if p >= pp or chunk >= vp:
                raise Unplaced(f"it holds buckets of dp_group_idx_{domain}, gbuf_idx_{chunk}")
            tried = []
            for name in orders:
                params = rank_params(dist, args, LAYER_ORDERS[name], t, p, chunk, gated)
                placed = (
                    _streamed(params, *sizes, _bucket_size(args))
                    if streams is not None
                    else _placed(params, sizes)
                )
                if placed is not None and _agrees(dist, placed):
                    break
                tried.append(name)
            else:
                raise Unplaced(
                    f"dp_group_idx_{domain}'s buckets match neither the {' nor the '.join(tried)} "
                    "layer spec's parameter order"
                )
            for key, piece in placed:
                # what tensor ranks hold alike (norms, row-parallel biases): the first's
                if all(piece.box != p.box for p in pieces.get(key, ())):
                    pieces.setdefault(key, []).append(piece)
        shapes = {key: _shape(dist, key) for key in pieces}
        return cls(dist, pieces, shapes)

    @property
    def bytes_read(self) -> int:
        return self.dist.bytes_read

    def read_object(self, key: str) -> Any:
        return self.dist.read_object(key)

    @staticmethod
    def _split(key: str) -> tuple[str, str] | None:
        """(state, model key) of an optimizer-state key, or None."""
        if not key.startswith(PREFIX):
            return None
        state, _, model_key = key[len(PREFIX) :].partition(".")
        return (state, model_key) if state in STATES else None

    def has(self, key: str) -> bool:
        split = self._split(key)
        return self.dist.has(key) if split is None else split[1] in self.pieces

    def shape(self, key: str) -> tuple[int, ...]:
        split = self._split(key)
        return self.dist.shape(key) if split is None else self.shapes[split[1]]

    def dtype(self, key: str) -> torch.dtype:
        split = self._split(key)
        if split is None:
            return self.dist.dtype(key)
        return self.dist.dtype(f"{self.pieces[split[1]][0].bucket}.{split[0]}")

    def covers(self, key: str, box: Box) -> bool:
        split = self._split(key)
        if split is None:
            return self.dist.covers(key, box)
        parts = (p.box.intersect(box) for p in self.pieces.get(split[1], ()))
        return sum(part.numel for part in parts if part is not None) == box.numel

    def read(self, wanted: list[tuple[str, Box, torch.Tensor]]) -> None:
        """Fill each (key, box, out); a state's box from the bucket ranges of the pieces it
        meets, each read once."""
        plain, ranges = [], {}
        for key, box, out in wanted:
            split = self._split(key)
            if split is None:
                plain.append((key, box, out))
                continue
            state, model_key = split
            for piece in self.pieces.get(model_key, ()):
                part = piece.box.intersect(box)
                if part is not None:
                    ranges.setdefault((piece, state), []).append((part, box, out))
        self.dist.read(plain)
        flat, reads = {}, []
        for piece, state in ranges:
            values = torch.empty(piece.box.numel, dtype=self.dist.dtype(f"{piece.bucket}.{state}"))
            flat[(piece, state)] = values
            reads.append(
                (f"{piece.bucket}.{state}", Box((piece.start,), (piece.box.numel,)), values)
            )
        self.dist.read(reads)
        for (piece, state), parts in ranges.items():
            values = flat[(piece, state)].reshape(piece.box.shape)
            for part, box, out in parts:
                out[part.within(box)].copy_(values[part.within(piece.box)])


def _buckets(dist: Any) -> dict[tuple[int, int], list[tuple[str, int]]]:
    """{(dp_group_idx, gbuf_idx): [(bucket key prefix, its unpadded elements)] by bucket index}."""
    found: dict[tuple[int, int], dict[int, tuple[str, int]]] = {}
    dtypes: dict[tuple[int, int], set[str]] = {}
    for key in dist.tensors:
        m = _BUCKET.fullmatch(key)
        if m is None or m.group(5) != "param":
            continue
        domain, chunk, bucket = int(m.group(1)), int(m.group(2)), int(m.group(4))
        dtypes.setdefault((domain, chunk), set()).add(m.group(3))
        found.setdefault((domain, chunk), {})[bucket] = (key[: -len(".param")], dist.shape(key)[0])
    for where, kinds in dtypes.items():
        if len(kinds) > 1:
            raise Unplaced(f"dp_group_idx_{where[0]} has buffers of {len(kinds)} dtypes")
    return {k: [v[i] for i in sorted(v)] for k, v in found.items()}


def _layers(args: Any, p: int, chunk: int) -> range:
    """The global layer indices of pipeline rank p's model chunk (Megatron's even split)."""
    layers = int(args.num_layers)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    if layers % (pp * vp):
        raise Unplaced(f"its {layers} layers do not split evenly over {pp * vp} stages")
    per = layers // (pp * vp)
    first = chunk * (layers // vp) + p * per
    return range(first, first + per)


def rank_params(
    dist: Any, args: Any, order: list, t: int, p: int, chunk: int, gated: bool
) -> list[Param]:
    """Tensor rank t's parameters on pipeline rank p's model chunk, in registration order: those of
    `order` for each layer, the embeddings first and the final norm and output layer last where
    the chunk holds them; each the boxes of its key's global tensor it holds."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    first, last = p == 0 and chunk == 0, p == pp - 1 and chunk == vp - 1

    def held(names: tuple[str, ...], split: int | None, layer: int | None) -> Param | None:
        key = next((k for k in names if dist.has(k)), None)
        if key is None:
            return None
        shape = dist.shape(key)[0 if layer is None else 1 :]
        gate = gated and key in _GATED_FC1
        return Param(key, _local_boxes(shape, split, t, tp, layer, gate))

    params = []
    if first:
        params += [held(names, split, None) for names, split in _PRE]
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        if tied and pp > 1 and params[0] is not None:
            params[0] = Param(params[0].key, params[0].boxes, shared=True)
    for layer in _layers(args, p, chunk):
        params += [held(names, split, layer) for names, split in order]
    if last:
        params += [held(names, split, None) for names, split in _POST]
        tied = not getattr(args, "untie_embeddings_and_output_weights", False)
        if not tied:
            params.append(held((_OUTPUT,), 0, None))
        elif pp > 1:
            # the last stage's copy of a tied embedding: a parameter of its own there
            embedding = held((_EMBEDDING,), 0, None)
            params.append(embedding and Param(_OUTPUT, embedding.boxes, shared=True))
    return [x for x in params if x is not None]


def _local_boxes(
    shape: tuple[int, ...], split: int | None, t: int, tp: int, layer: int | None, gate: bool
) -> tuple[Box, ...]:
    """Rank t's boxes of a tensor of `shape` (one layer's) split `split` over tp ranks: one, or a
    gated fc1's gate part then its up part, in its stacked global tensor."""
    lead = () if layer is None else (layer,)
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


def _placed(params: list[Param], sizes: list[tuple[str, int]]) -> list | None:
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


def _bucket_size(args: Any) -> int | None:
    """The elements at which megatron-core's DDP closes a bucket, as Megatron-LM configures it
    (none without --overlap-grad-reduce)."""
    if not getattr(args, "overlap_grad_reduce", False):
        return None
    if getattr(args, "ddp_bucket_size", None):
        return int(args.ddp_bucket_size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    return max(40_000_000, 1_000_000 * dp)


def _streamed(params: list[Param], prefix: str, total: int, bucket_size: int | None) -> list | None:
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


def _agrees(dist: Any, placed: list[tuple[str, Piece]]) -> bool:
    """Whether each parameter's fp32 master at its first row equals the model's weight there."""
    reads, pairs = [], []
    for key, piece in placed:
        # a tied embedding's last-stage copy: no weight of its own to check against
        if not dist.has(key):
            continue
        row = piece.box.shape[-1]
        box = Box(piece.box.offset, (*(1,) * (len(piece.box.shape) - 1), row))
        weight = torch.empty(box.shape, dtype=dist.dtype(key))
        master = torch.empty(row, dtype=dist.dtype(f"{piece.bucket}.param"))
        reads += [
            (key, box, weight),
            (f"{piece.bucket}.param", Box((piece.start,), (row,)), master),
        ]
        pairs.append((weight.reshape(-1), master))
    dist.read(reads)
    return all(torch.equal(master.to(w.dtype), w) for w, master in pairs)


def _shape(dist: Any, key: str) -> tuple[int, ...]:
    return dist.shape(key if dist.has(key) or key != _OUTPUT else _EMBEDDING)
