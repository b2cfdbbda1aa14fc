"""GPT training samples from an indexed dataset, in Megatron's order.

A sample is seq_len + 1 consecutive tokens of the split's documents, concatenated over epochs in a
shuffled document order; sample k starts at token k * seq_len of that stream, so consecutive samples
share one token. Three indices define everything, built once and cached as .npy files under a name
that hashes every input that changes them:

    document_index
        documents of all epochs, shuffled (numpy RandomState(seed); the final epoch shuffled
                    apart when it contributes less than 80% of an epoch's samples)
    sample_index
        [num_samples + 1, 2]: (position in document_index, token offset) of each sample start
    shuffle_index   a permutation of the samples (the final epoch again apart)

For the same files, seed, sequence length, documents and sample count this yields the samples of
megatron-core's GPTDataset in the same order.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from fmeg.data.fim import sample_rng
from fmeg.data.indexed import IndexedDataset

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_len: int) -> int:
    """Epochs of the split needed for num_samples samples of seq_len + 1 tokens."""
    needed = num_samples * seq_len + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """The split's documents repeated num_epochs times, shuffled (int32)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate([first, build_document_index(documents, 1, rng, False)])


def build_sample_index(
    lengths: np.ndarray, document_index: np.ndarray, seq_len: int, num_samples: int
) -> np.ndarray:
    """(position in document_index, offset) of token k * seq_len of the stream, for k =
    0..num_samples."""
    # tokens before each stream position
    prefix = np.empty(len(document_index) + 1, dtype=np.int64)
    prefix[0] = 0
    prefix[1:] = lengths[document_index]
    # in place on int64: about twice as fast as a converting cumsum
    np.cumsum(prefix[1:], out=prefix[1:])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    if num_samples and starts[-1] >= prefix[-1]:
        raise ValueError(
            f"{num_samples} samples of {seq_len + 1} tokens need more than the {int(prefix[-1])} "
            "tokens of the document index"
        )
    position = np.searchsorted(prefix, starts, side="right") - 1
    dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < 2**31 else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0] = position
    out[:, 1] = starts - prefix[position]
    return out


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_indices(
    lengths: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """document_index, sample_index, shuffle_index (Megatron's construction, RandomState order
    included)."""
    documents = np.asarray(documents)
    contiguous = (
        len(documents)
        and documents[-1] - documents[0] + 1 == len(documents)
        and bool((np.diff(documents) == 1).all())
    )
    # A split is a range of documents: sum a slice (a view) rather than gathering them.
    chosen = lengths[documents[0] : documents[-1] + 1] if contiguous else lengths[documents]
    tokens_per_epoch = int(chosen.sum(dtype=np.int64))
    if tokens_per_epoch < seq_len + 1:
        raise ValueError(
            f"--seq-length {seq_len} is larger than the split's {tokens_per_epoch} tokens"
        )
    epochs = 1 if num_samples is None else num_epochs_needed(tokens_per_epoch, num_samples, seq_len)
    separate = False
    if epochs > 1:
        before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate = num_samples - before_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    total = (epochs * tokens_per_epoch - 1) // seq_len
    sample_index = build_sample_index(lengths, document_index, seq_len, total)
    shuffle_index = build_shuffle_index(before_final if separate else total, total, rng)
    return document_index, sample_index, shuffle_index


def documents_of(
    tokens: torch.Tensor,
    eod_id: int | None,
    *,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
) -> dict[str, torch.Tensor]:
    """A sample's packed documents as megatron-core's GPTDataset cuts them: a document ends after
    each end-of-document token of the input tokens. reset_position_ids: "position_ids" restart at 0
    in each document; reset_attention_mask: "cu_seqlens" [s + 1], the documents' cumulative lengths
    padded with s (each document attends to itself only: fmeg.ops.document_attention)."""
    s = tokens.shape[0]
    out = {}
    ends = (tokens == eod_id).nonzero().flatten() + 1 if eod_id is not None else tokens.new_empty(0)
    ends = ends[ends < s]
    if reset_position_ids:
        starts = torch.zeros(s, dtype=torch.int64)
        starts[ends] = ends
        out["position_ids"] = torch.arange(s) - starts.cummax(0).values
    if reset_attention_mask:
        cu_seqlens = torch.full((s + 1,), s, dtype=torch.int64)
        cu_seqlens[0] = 0
        cu_seqlens[1 : len(ends) + 1] = ends
        out["cu_seqlens"] = cu_seqlens
    return out


class GPTDataset(torch.utils.data.Dataset):
    """Samples {"tokens", "labels", "loss_mask", "position_ids"} of seq_len tokens from `documents`
    of an IndexedDataset, with "cu_seqlens" under reset_attention_mask (documents_of). loss_mask is
    0 where the input token is an end of document when eod_mask_loss (megatron-core's GPTDataset:
    the next document's first token is not predicted from the previous one). fim
    (fmeg.data.fim.FIM): each sample's documents rearranged for fill-in-the-middle,
    deterministically per (seed, index), its padding not trained on."""

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_len: int,
        num_samples: int | None,
        seed: int,
        *,
        eod_id: int | None = None,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        fim=None,
        cache_dir: str | os.PathLike | None = None,
        name: str = "train",
    ):
        if len(documents) == 0:
            raise ValueError(f"{indexed.prefix}: the {name} split has no documents")
        if int(indexed.sequence_lengths[np.asarray(documents)].sum(dtype=np.int64)) < seq_len + 1:
            raise ValueError(
                f"{indexed.prefix}: --seq-length {seq_len} is larger than the {name} split's "
                f"{int(indexed.sequence_lengths[np.asarray(documents)].sum())} tokens"
            )
        self.indexed, self.seq_len, self.eod_id, self.eod_mask_loss = (
            indexed,
            seq_len,
            eod_id,
            eod_mask_loss,
        )
        self.reset_position_ids, self.reset_attention_mask = (
            reset_position_ids,
            reset_attention_mask,
        )
        self.fim, self.seed = fim, seed
        description = {
            "prefix": os.path.abspath(indexed.prefix),
            "documents": [int(documents[0]), int(documents[-1]), len(documents)],
            "seq_len": seq_len,
            "num_samples": num_samples,
            "seed": seed,
            "index_bytes": os.path.getsize(indexed.prefix + ".idx"),
            "split": name,
        }
        key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        cached = _load_cached(cache_dir, key)
        if cached is None:
            cached = build_indices(
                indexed.sequence_lengths, np.asarray(documents), seq_len, num_samples, seed
            )
            _save_cached(cache_dir, key, cached, description)
        self.document_index, self.sample_index, self.shuffle_index = cached
        self.num_samples = len(self.shuffle_index) if num_samples is None else num_samples

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, i: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample i (int64)."""
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        if d0 == d1:
            return np.asarray(
                self.indexed.get(int(self.document_index[d0]), int(o0), int(o1 - o0 + 1)), np.int64
            )
        parts = [self.indexed.get(int(self.document_index[d0]), int(o0))]
        parts += [self.indexed.get(int(self.document_index[d])) for d in range(d0 + 1, d1)]
        parts.append(self.indexed.get(int(self.document_index[d1]), 0, int(o1 + 1)))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        text = self.sample_tokens(i)
        if self.fim is not None:
            text = self.fim(text, sample_rng(self.seed, i))
        text = torch.from_numpy(text)
        tokens, labels = text[:-1], text[1:]
        loss_mask = torch.ones(self.seq_len, dtype=torch.float32)
        if self.eod_mask_loss and self.eod_id is not None:
            loss_mask[tokens == self.eod_id] = 0.0
        if self.fim is not None:
            loss_mask[labels == self.fim.pad] = 0.0
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": torch.arange(self.seq_len, dtype=torch.int64),
            **documents_of(
                tokens,
                self.eod_id,
                reset_position_ids=self.reset_position_ids,
                reset_attention_mask=self.reset_attention_mask,
            ),
        }


class MockGPTDataset(torch.utils.data.Dataset):
    """Random tokens in the GPTDataset sample format, a pure function of (seed, index); for
    tests."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.num_samples, self.seq_len, self.vocab_size, self.seed = (
            num_samples,
            seq_len,
            vocab_size,
            seed,
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(
            np.random.default_rng([self.seed, i]).integers(0, self.vocab_size, self.seq_len + 1)
        )
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(self.seq_len),
            "position_ids": torch.arange(self.seq_len),
        }


def _paths(cache_dir, key):
    base = Path(cache_dir) / key
    return [
        base.with_name(f"{key}-{n}.npy")
        for n in ("document_index", "sample_index", "shuffle_index")
    ]


def _load_cached(cache_dir, key):
    if cache_dir is None:
        return None
    paths = _paths(cache_dir, key)
    if not all(p.is_file() for p in paths):
        return None
    return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)


def _save_cached(cache_dir, key, arrays, description):
    if cache_dir is None:
        return
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    for path, array in zip(_paths(cache_dir, key), arrays):
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        # the last writer wins; every writer writes the same bytes
        os.replace(tmp, path)
    meta = Path(cache_dir) / f"{key}-description.json"
    meta.write_text(json.dumps(description, indent=1, sort_keys=True))
