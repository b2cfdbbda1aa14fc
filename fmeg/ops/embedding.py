"""Table lookup."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids]: ids of any shape, table [num_embeddings, dim] -> [*ids.shape, dim]."""
    return F.embedding(ids, table)
