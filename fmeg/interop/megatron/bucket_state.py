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
With experts, a layer's MLP registers its router, its local experts (each expert's fc1 and fc2)
and its shared experts; where the experts are parallel (ep > 1, or their own tp) they have
buffers of their own: Megatron's chained optimizer saves the dense ones under "chained_0." and
the experts' under "chained_1.", whose dp_group_idx is the rank among the experts' tp x ep x pp.
A legacy directory's distrib_optim.pt holds each buffer's buckets concatenated without their
padding: there buckets close where megatron-core's DDP closes them (_streamed).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from fmeg.checkpoint.boxes import Box
from fmeg.interop.megatron.torch_dist import rows_needed
from fmeg.interop.megatron.bucket_layout import (
    EMBEDDING,
    LAYER_ORDERS,
    OUTPUT,
    UNPLACED_FLAGS,
    Piece,
    Unplaced,
    bucket_size_of,
    owner_of,
    placed_in,
    rank_params,
    streamed_in,
)

PREFIX = "optimizer.state."
STATES = ("param", "exp_avg", "exp_avg_sq")
# a chained optimizer's (dense, then experts') keys start "chained_<index>."
_BUCKET = re.compile(
    r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)"
    r"\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)"
)


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
        set_flags = [f for f in UNPLACED_FLAGS if getattr(args, f, None)]
        if set_flags:
            raise Unplaced(f"its model uses --{set_flags[0].replace('_', '-')}")
        impl = getattr(args, "transformer_impl", "transformer_engine")
        orders = sorted(LAYER_ORDERS, key=lambda name: name != impl)
        pieces: dict[str, list[Piece]] = {}
        boxes: dict[str, set[Box]] = {}
        for (optimizer, domain, chunk), sizes in sorted(buckets.items(), key=_none_first):
            owner = owner_of(args, optimizer, domain, chunk)
            tried = []
            for name in orders:
                params = rank_params(dist, args, LAYER_ORDERS[name], owner, gated)
                placed = (
                    streamed_in(params, *sizes, bucket_size_of(args))
                    if streams is not None
                    else placed_in(params, sizes)
                )
                if placed is not None and _agrees(dist, placed):
                    break
                tried.append(name)
            else:
                raise Unplaced(
                    f"the buckets of dp_group_idx_{domain}"
                    + ("" if optimizer is None else f" of chained_{optimizer}")
                    + f" match neither the {' nor the '.join(tried)} layer spec's parameter order"
                )
            for key, piece in placed:
                # what tensor ranks hold alike (norms, row-parallel biases): the first's
                if piece.box not in boxes.setdefault(key, set()):
                    boxes[key].add(piece.box)
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
        for (piece, state), parts in ranges.items():
            # of the piece, only the run of whole rows (contiguous in the bucket) its parts need
            region = rows_needed(piece.box, [part for part, _, _ in parts])
            first = sum(
                (o - po) * math.prod(piece.box.shape[d + 1 :])
                for d, (o, po) in enumerate(zip(region.offset, piece.box.offset))
            )
            values = torch.empty(region.numel, dtype=self.dist.dtype(f"{piece.bucket}.{state}"))
            flat[(piece, state)] = (region, values)
            at = Box((piece.start + first,), (region.numel,))
            reads.append((f"{piece.bucket}.{state}", at, values))
        self.dist.read(reads)
        for (piece, state), parts in ranges.items():
            region, values = flat[(piece, state)]
            values = values.reshape(region.shape)
            for part, box, out in parts:
                out[part.within(box)].copy_(values[part.within(region)])


def _buckets(dist: Any) -> dict[tuple, list[tuple[str, int]]]:
    """{(chained optimizer or None, dp_group_idx, gbuf_idx): [(bucket key prefix, its unpadded
    elements)] by bucket index}."""
    found: dict[tuple, dict[int, tuple[str, int]]] = {}
    dtypes: dict[tuple, set[str]] = {}
    for key in dist.tensors:
        m = _BUCKET.fullmatch(key)
        if m is None or m.group(6) != "param":
            continue
        optimizer = None if m.group(1) is None else int(m.group(1))
        where = (optimizer, int(m.group(2)), int(m.group(3)))
        dtypes.setdefault(where, set()).add(m.group(4))
        found.setdefault(where, {})[int(m.group(5))] = (key[: -len(".param")], dist.shape(key)[0])
    for where, kinds in dtypes.items():
        if len(kinds) > 1:
            raise Unplaced(f"dp_group_idx_{where[1]} has buffers of {len(kinds)} dtypes")
    return {k: [v[i] for i in sorted(v)] for k, v in found.items()}


def _none_first(item: tuple) -> tuple:
    (optimizer, domain, chunk), _ = item
    return (-1 if optimizer is None else optimizer, domain, chunk)


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
    return dist.shape(key if dist.has(key) or key != OUTPUT else EMBEDDING)
