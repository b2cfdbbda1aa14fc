"""Vocabulary padding of a GPT's tables: rows V..Vp-1 are zero and inert, so any padding computes
the same."""

from __future__ import annotations

from typing import Any

import torch

VOCAB_TABLES = ("embedding.word.weight", "output.weight")


def pad_rows(table: torch.Tensor, rows: int) -> torch.Tensor:
    """table [V', ...] cut or zero-padded to [rows, ...]."""
    # shapes only (gpt.init on the meta device)
    if table.is_meta:
        return table.new_empty((rows, *table.shape[1:]))
    if table.shape[0] >= rows:
        return table[:rows]
    return torch.cat([table, table.new_zeros((rows - table.shape[0], *table.shape[1:]))])


def repad_vocab(values: Any, config: Any, padded_vocab_size: int) -> Any:
    """A whole-model tree (parameters, gradients or Adam moments) with its vocabulary tables'
    padding replaced: the config.vocab_size real rows, then zero rows up to padded_vocab_size."""
    from fmeg import tree

    flat = tree.flatten(values)
    for path in VOCAB_TABLES:
        if path in flat:
            flat[path] = pad_rows(flat[path][: config.vocab_size], padded_vocab_size)
    return tree.unflatten(flat)
