"""Data-parallel gradient reduction in buckets: a few large all-reduces instead of one per parameter.

Leaves are packed in reverse order (the order backward produces them, as Megatron does) into flat fp32
buckets of about bucket_bytes, each all-reduced once and divided by the group size.
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg import tree

DEFAULT_BUCKET_BYTES = 25 * 2**20


def all_reduce_mean(grads: Any, group: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Any:
    """The mean of grads over the group's ranks, leaf for leaf (None group: unchanged)."""
    if group is None:
        return grads
    leaves, spec = tree.tree_flatten(grads)
    out: list[torch.Tensor | None] = [None] * len(leaves)
    bucket: list[int] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([leaves[i].reshape(-1) for i in bucket])
        reduced = group.all_reduce(flat) / group.size
        for i, piece in zip(bucket, reduced.split([leaves[i].numel() for i in bucket])):
            out[i] = piece.view_as(leaves[i])
        bucket.clear()

    for i in reversed(range(len(leaves))):
        if bucket and leaves[i].dtype != leaves[bucket[0]].dtype:
            flush()
            size = 0
        bucket.append(i)
        size += leaves[i].numel() * leaves[i].element_size()
        if size >= bucket_bytes:
            flush()
            size = 0
    flush()
    return tree.tree_unflatten(out, spec)
