"""Splits, blends and sample counts: how Megatron turns --data-path, --split and iteration counts
into datasets. All pure functions.
"""

from __future__ import annotations

import re

import numpy as np


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalised [train, valid, test] weights (missing ones are 0)."""
    parts = re.findall(r"[^,/\s]+", split)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(
            f"--split {split!r}: expected up to three comma-separated numbers, e.g. 969,30,1"
        ) from None
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"--split {split!r}: expected up to three non-negative numbers with a positive sum"
        )
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """[begin, end) documents of train, valid and test (None for a zero weight), Megatron's
    rounding."""
    weights, bounds, ranges = parse_split(split), [0.0], []
    for w in weights:
        bounds.append(bounds[-1] + w)
    for i, w in enumerate(weights):
        ranges.append(
            None
            if w == 0
            else (int(round(bounds[i] * num_documents)), int(round(bounds[i + 1] * num_documents)))
        )
    return ranges


def parse_blend(data_path: list[str] | str) -> tuple[list[str], list[float]]:
    """'30 prefixA 70 prefixB' (or a list of those words) -> (prefixes, normalised weights); a lone
    prefix has weight 1."""
    words = (
        data_path.split()
        if isinstance(data_path, str)
        else [w for item in data_path for w in item.split()]
    )
    if len(words) == 1:
        return words, [1.0]
    if len(words) % 2:
        raise ValueError(
            f"--data-path {' '.join(words)!r}: expected weight prefix pairs, e.g. '30 a 70 b'"
        )
    try:
        weights = [float(w) for w in words[0::2]]
    except ValueError:
        raise ValueError(
            f"--data-path {' '.join(words)!r}: weights must be numbers, as in '30 a 70 b'"
        ) from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"--data-path {' '.join(words)!r}: weights must be non-negative with a positive sum"
        )
    total = sum(weights)
    return words[1::2], [w / total for w in weights]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample, index of the sample within that dataset): each sample goes to the
    dataset furthest behind its share, weight * max(i, 1) - taken so far (ties to the lowest index).

    This is Megatron's order, kept so a blend reproduces a Megatron run: after n samples each count
    is within one sample of weight * max(n - 1, 1), so within 1 + weight of weight * n."""
    w = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(w), dtype=np.int64)
    dataset = np.empty(size, dtype=np.int16)
    within = np.empty(size, dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(w * max(i, 1) - taken))
        dataset[i], within[i] = d, taken[d]
        taken[d] += 1
    return dataset, within


def target_samples(
    train_iters: int, global_batch: int, eval_interval: int, eval_iters: int
) -> list[int]:
    """Samples needed for [train, valid, test]: Megatron's train_iters * gbs, (train_iters //
    interval + 1)
    * eval_iters * gbs, eval_iters * gbs."""
    evaluations = train_iters // eval_interval + 1 if eval_interval else 1
    return [
        train_iters * global_batch,
        evaluations * eval_iters * global_batch,
        eval_iters * global_batch,
    ]


class BlendedDataset:
    """Samples of several datasets interleaved by weight (Megatron's BlendedDataset order)."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        self.datasets = datasets
        self.dataset_index, self.sample_index = blending_indices(weights, size)
        for d, ds in enumerate(datasets):
            need = int((self.dataset_index == d).sum())
            if need > len(ds):
                raise ValueError(
                    f"blend: dataset {d} has {len(ds)} samples, the blend needs {need}"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int):
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]


def build_datasets(
    data_path: list[str] | str,
    split: str,
    seq_len: int,
    num_samples: list[int],
    seed: int,
    *,
    cache_dir=None,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    fim=None,
    surplus: float = 0.005,
    vocab_size: int | None = None,
) -> list:
    """[train, valid, test] datasets from --data-path, --split and sample counts (None where a split
    is empty or needs no samples). A blend draws ceil(weight * samples * (1 + surplus)) samples from
    each prefix, as Megatron does, then interleaves them by weight. vocab_size: every token id of
    every prefix must lie below it (token_range.check_token_ids; the ranges are cached under
    cache_dir, else $FMEG_CACHE). fim: fmeg.data.fim.FIM, for fill-in-the-middle samples."""
    from fmeg.data.default_corpus import cache_dir as fmeg_cache
    from fmeg.data.gpt_dataset import GPTDataset
    from fmeg.data.indexed import IndexedDataset
    from fmeg.data.token_range import check_token_ids

    prefixes, weights = parse_blend(data_path)
    indexed = [IndexedDataset(p) for p in prefixes]
    if vocab_size is not None:
        for ix in indexed:
            check_token_ids(ix, vocab_size, cache_dir or fmeg_cache())
    names = ("train", "valid", "test")
    out = []
    for i, wanted in enumerate(num_samples):
        ranges = [split_document_ranges(split, ix.num_documents)[i] for ix in indexed]
        if not wanted or any(r is None or r[0] == r[1] for r in ranges):
            out.append(None)
            continue
        parts = []
        for ix, w, (begin, end) in zip(indexed, weights, ranges):
            count = wanted if len(indexed) == 1 else int(np.ceil(w * wanted * (1 + surplus)))
            parts.append(
                GPTDataset(
                    ix,
                    np.arange(begin, end, dtype=np.int32),
                    seq_len,
                    count,
                    seed,
                    eod_id=eod_id,
                    eod_mask_loss=eod_mask_loss,
                    reset_position_ids=reset_position_ids,
                    reset_attention_mask=reset_attention_mask,
                    fim=fim,
                    cache_dir=cache_dir,
                    name=names[i],
                )
            )
        out.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, wanted))
    return out
