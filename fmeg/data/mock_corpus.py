"""Megatron's --mock-data: synthetic documents for runs that name no data (benchmarks, smoke tests).

As Megatron's mock dataset, there are 100,000 documents, so that its scripts' splits ("99990,8,2")
leave every split some; their lengths are drawn uniformly from [1, 128) by numpy's RandomState(0)
(Megatron draws up to 4096 and generates them on the fly; these are written to disk, 6.4M tokens),
each ends with the end-of-document token, and their tokens are a counter (1, 2, 3, ...) taken modulo
the tokenizer's vocabulary (end-of-document excluded), so any tokenizer can train on them. Written
once as an indexed dataset under the cache directory, keyed by the vocabulary and end-of-document
id.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fmeg.data.default_corpus import cache_dir
from fmeg.data.indexed import IndexedDataset, IndexedDatasetBuilder

DOCUMENTS, MAX_LENGTH = 100_000, 128


def mock_corpus(
    vocab_size: int, eod: int, directory: str | os.PathLike | None = None
) -> IndexedDataset:
    directory = Path(directory) if directory is not None else cache_dir()
    prefix = directory / f"mock-v{vocab_size}-e{eod}-d{DOCUMENTS}-l{MAX_LENGTH}"
    if not (Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()):
        directory.mkdir(parents=True, exist_ok=True)
        dtype = np.uint16 if vocab_size < 65500 else np.int32
        builder = IndexedDatasetBuilder(f"{prefix}.{os.getpid()}", dtype)
        lengths = np.random.RandomState(0).randint(1, MAX_LENGTH, size=DOCUMENTS)
        ids = np.array([t for t in range(vocab_size) if t != eod] or [0])
        for length in lengths:
            counter = np.arange(1, length) % len(ids)
            builder.add_document(np.append(ids[counter], eod).astype(dtype))
        builder.finalize()
        # .idx last: a reader never sees an index without its data
        for suffix in (".bin", ".idx"):
            os.replace(f"{prefix}.{os.getpid()}{suffix}", f"{prefix}{suffix}")
    return IndexedDataset(prefix)
