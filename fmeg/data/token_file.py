"""A flat stream of token ids, and fixed-length training windows drawn from it.

Sources: a .npy array (read with allow_pickle=False), a raw .bin of one integer dtype (nanoGPT's
train.bin), a Megatron .bin/.idx prefix (all its tokens in file order), or text turned into bytes
(vocabulary 256, no tokenizer needed). GPT samples in Megatron's order are fmeg.data.gpt_dataset's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch


def load_tokens(path: str | os.PathLike, dtype: str = "uint16") -> np.ndarray:
    """Token ids from path (.npy, or raw .bin of `dtype`), memory-mapped; errors name the file."""
    path = Path(path)
    # a Megatron indexed dataset prefix: every token, in file order
    if Path(f"{path}.idx").is_file():
        from fmeg.data.indexed import IndexedDataset

        tokens = np.asarray(IndexedDataset(path).tokens)
    elif not path.is_file():
        raise ValueError(f"--data-path {path}: no such file (nor {path}.idx / .bin)")
    elif path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"--data-path {path}: not a plain .npy array ({e})") from None
    else:
        itemsize = np.dtype(dtype).itemsize
        if path.stat().st_size % itemsize:
            raise ValueError(
                f"--data-path {path}: size {path.stat().st_size} is not a multiple of {dtype}'s "
                f"{itemsize} bytes; pass the right --token-dtype"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"--data-path {path}: expected a 1-D array of integer token ids, got {tokens.dtype} "
            f"with shape {tokens.shape}"
        )
    return tokens


def random_windows(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> dict:
    """A batch of windows of seq_len + 1 tokens at random offsets, a pure function of (seed, step).

    Returns {"tokens": [batch, seq], "labels": [batch, seq]} (labels are tokens shifted by one).
    """
    if len(tokens) < seq_len + 2:
        raise ValueError(
            f"--seq-length {seq_len} needs at least {seq_len + 2} tokens, the data has "
            f"{len(tokens)}"
        )
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    windows = torch.from_numpy(
        np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts])
    )
    return {"tokens": windows[:, :-1], "labels": windows[:, 1:]}


class TokenWindows:
    """Sample i is the window of seq_len + 1 tokens at a random offset drawn from (seed, i), as the
    runner's datasets give it: {"tokens", "labels", "loss_mask"} of seq_len each."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"--seq-length {seq_len} needs at least {seq_len + 2} tokens, the data has "
                f"{len(tokens)}"
            )
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def __getitem__(self, i: int) -> dict:
        start = int(
            np.random.default_rng([self.seed, i]).integers(0, len(self.tokens) - self.seq_len - 1)
        )
        window = torch.from_numpy(
            np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        )
        return {"tokens": window[:-1], "labels": window[1:], "loss_mask": torch.ones(self.seq_len)}
