"""Data pipeline speed: preprocessing throughput, and GPT index building for 100M tokens beside
megatron-core.

    python bench/data.py                         # 100M tokens, seq 2048, one epoch
    python bench/data.py --tokens 20000000       # quicker

Builds a synthetic indexed dataset (uint16, documents of 1 to 2 * --mean-document-tokens), then
times, in the same run, fmeg's build_indices and megatron-core's GPTDataset constructor (its
document, sample and shuffle index build, C++ helpers included; no cache) for the same documents,
seed and sample count, checking that both give the same first samples. Preprocessing is timed on
generated JSON lines with the byte tokenizer (megatron-core ships no preprocessing tool to compare
with).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from fmeg.data.gpt_dataset import GPTDataset, build_indices
from fmeg.data.indexed import IndexedDataset, IndexedDatasetBuilder


def synthetic_corpus(
    prefix: Path, tokens: int, mean_document: int, seed: int = 0
) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * mean_document, size=int(tokens / mean_document * 1.1))
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens) + 1]
    data = rng.integers(0, 50000, size=int(lengths.sum()), dtype=np.uint16)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    # one write; then make each sequence its own document
    builder.add_document(data, lengths=lengths.tolist())
    builder.document_indices = list(range(len(lengths) + 1))
    builder.finalize()
    return IndexedDataset(prefix)


def time_megatron(prefix: Path, documents: np.ndarray, seq: int, samples: int, seed: int):
    from megatron.core.datasets.gpt_dataset import GPTDataset as CoreGPT
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreIndexed
    from megatron.core.datasets.utils import Split

    class Tok:
        eod, pad, vocab_size, unique_identifiers = 0, -1, 50000, {"class": "Tok"}

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        split="1,0,0",
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
        mmap_bin_files=True,
    )
    indexed = CoreIndexed(str(prefix))
    start = time.perf_counter()
    dataset = CoreGPT(indexed, str(prefix), documents, samples, Split.train, config)
    return time.perf_counter() - start, dataset


def bench_preprocess(directory: Path, megabytes: float) -> tuple[float, int]:
    from recipes import preprocess_data

    path = directory / "in.jsonl"
    line = json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 40})
    path.write_text("\n".join([line] * int(megabytes * 1e6 / len(line))) + "\n")
    start = time.perf_counter()
    preprocess_data.main(
        [
            "--input",
            str(path),
            "--output-prefix",
            str(directory / "pre"),
            "--append-eod",
            "--workers",
            "2",
            "--log-interval",
            "10000000",
        ]
    )
    elapsed = time.perf_counter() - start
    return elapsed, IndexedDataset(directory / "pre_text_document").num_tokens


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=100_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mean-document-tokens", type=int, default=1000)
    p.add_argument("--preprocess-mb", type=float, default=50.0)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        t0 = time.perf_counter()
        corpus = synthetic_corpus(directory / "corpus", a.tokens, a.mean_document_tokens)
        print(
            f"corpus: {corpus.num_tokens:,} tokens in {corpus.num_documents:,} documents (written "
            f"in {time.perf_counter() - t0:.1f} s)"
        )
        documents = np.arange(corpus.num_documents, dtype=np.int32)
        samples = (corpus.num_tokens - 1) // a.seq_length
        ours, theirs = [], []
        for r in range(a.repeats):
            start = time.perf_counter()
            build_indices(corpus.sequence_lengths, documents, a.seq_length, samples, seed=r)
            ours.append(time.perf_counter() - start)
            elapsed, core = time_megatron(
                directory / "corpus", documents, a.seq_length, samples, seed=r
            )
            theirs.append(elapsed)
        check = GPTDataset(corpus, documents, a.seq_length, samples, a.repeats - 1)
        same = all(
            np.array_equal(check[i]["tokens"].numpy(), core[i]["tokens"].numpy()) for i in range(20)
        )
        o, t = statistics.median(ours), statistics.median(theirs)
        print(
            f"\nindex build, {samples:,} samples of {a.seq_length} tokens (median of {a.repeats}; "
            f"first 20 samples identical: {same})"
        )
        print(f"{'implementation':<32} {'seconds':>9} {'ratio to megatron-core':>24}")
        print(f"{'megatron-core GPTDataset':<32} {t:>9.3f} {1.0:>24.3f}")
        print(f"{'fmeg build_indices':<32} {o:>9.3f} {o / t:>24.3f}")
        elapsed, tokens = bench_preprocess(directory, a.preprocess_mb)
        print(
            f"\npreprocess_data (ByteTokenizer, 2 workers, {a.preprocess_mb:.0f} MB of JSON "
            f"lines): {tokens / elapsed:,.0f} tokens/s ({tokens:,} tokens in {elapsed:.1f} s)"
        )


if __name__ == "__main__":
    main()
