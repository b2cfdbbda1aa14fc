"""ZeRO-1, the distributed optimizer: optimizer state sharded over data-parallel ranks.

    # the local params as one fp32 vector, padded to a multiple of dp
    flat = FlatBuffer.of(params, dp)
    shard = flat.shard(flat.flatten(grads), rank)
    ...

Each data-parallel rank owns a contiguous slice of the flattened local parameters. Gradients are
reduce-scattered (each rank receives the data-parallel sum of its slice), AdamW steps on the slice
only (its two moments cost 8 / dp bytes per parameter in fp32), and the updated slices are
all-gathered. The arithmetic per element is the replicated optimizer's, so the loss curve is the
same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg import tree


@dataclass(frozen=True)
class FlatBuffer:
    shapes: tuple[torch.Size, ...]
    spec: Any
    numel: int
    padded: int
    dp: int

    @classmethod
    def of(cls, params: Any, dp: int) -> "FlatBuffer":
        leaves, spec = tree.tree_flatten(params)
        numel = sum(x.numel() for x in leaves)
        padded = -(-numel // dp) * dp
        return cls(tuple(x.shape for x in leaves), spec, numel, padded, dp)

    def flatten(self, values: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        flat = torch.cat([x.reshape(-1).to(dtype) for x in tree.tree_leaves(values)])
        return torch.nn.functional.pad(flat, (0, self.padded - self.numel))

    def unflatten(self, flat: torch.Tensor, like: Any) -> Any:
        pieces = flat[: self.numel].split([s.numel() for s in self.shapes])
        leaves = [
            p.view(s).to(x.dtype) for p, s, x in zip(pieces, self.shapes, tree.tree_leaves(like))
        ]
        return tree.tree_unflatten(leaves, self.spec)

    def views(self, flat: torch.Tensor) -> Any:
        """The tree whose leaves are views of flat (no copy): writing either changes both."""
        pieces = flat[: self.numel].split([s.numel() for s in self.shapes])
        return tree.tree_unflatten([p.view(s) for p, s in zip(pieces, self.shapes)], self.spec)

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        size = self.padded // self.dp
        return flat[rank * size : (rank + 1) * size]
