"""The GPT's leaves as Muon and SOAP see them (fmeg.optim.LeafMatrices): which leaves are matrices,
and the 2-D matrices a whole (unsharded) leaf is orthogonalized as, the way Megatron-LM's
parameters are.

    matrices = GPTMatrices(config, split_qkv=True)
    matrices.is_matrix("layers.0.attn.qkv.weight", leaf)    # True
    q, k, v = matrices.split("layers.0.attn.qkv.weight", whole)

Megatron gives its scalar optimizer the embeddings, the output layer and every parameter that is not
2-D; fmeg's leaves differ from Megatron's parameters in shape only where it stacks them: a gated
MLP's fc1 [2, F, H] is Megatron's [2F, H] (gate rows, then up rows), an experts leaf [E, ...] is E
parameters (one per expert, as TE's grouped linear holds them). The qkv weight's query, key and
value rows are orthogonalized apart (row_blocks) unless --muon-no-split-qkv. Orthogonalization
commutes with reordering rows, so the order of the rows inside a matrix (Megatron's per-rank [gate;
up] blocks) changes nothing.
"""

from __future__ import annotations

import torch

from fmeg.models import gpt, self_attention

# the word and position embeddings, the output layer and the MTP depths' embedding copy
SCALAR_TABLES = ("embedding.", "output.", "mtp_embedding.")


def _experts(path: str) -> bool:
    return ".mlp.experts." in path


class GPTMatrices:
    """fmeg.optim.LeafMatrices for gpt's parameter paths (without a stage prefix)."""

    def __init__(self, config: gpt.GPTConfig, split_qkv: bool = True):
        self.config, self.split_qkv = config, split_qkv

    def is_matrix(self, path: str, leaf: torch.Tensor) -> bool:
        if path.startswith(SCALAR_TABLES):
            return False
        return leaf.dim() >= (3 if _experts(path) else 2)

    def split(self, path: str, whole: torch.Tensor) -> list[torch.Tensor]:
        if _experts(path):
            return [e.reshape(-1, whole.shape[-1]) for e in whole.unbind(0)]
        return [whole.reshape(-1, whole.shape[-1])]

    def join(self, path: str, parts: list[torch.Tensor], whole: torch.Tensor) -> torch.Tensor:
        if _experts(path):
            return torch.stack(parts).reshape(whole.shape)
        return parts[0].reshape(whole.shape)

    def row_blocks(self, path: str, rows: int) -> list[torch.Tensor] | None:
        """The query, key and value rows of the grouped qkv weight (split_qkv's order)."""
        if not (self.split_qkv and path.endswith("attn.qkv.weight")):
            return None
        return list(self_attention.split_qkv(torch.arange(rows), self.config))
