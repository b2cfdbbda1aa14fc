"""The smallest and largest token id of an indexed dataset, checked against the vocabulary before
training.

    check_token_ids(IndexedDataset(prefix), vocab_size)     # DataError naming the .bin and the fix

An id outside [0, vocab_size) indexes past the embedding: at tp 1 an IndexError mid-run, under
tensor parallelism (each rank looks up only its own rows) silently wrong training. One pass over the
.bin finds the range, in chunks of the memory map; the result is cached under $FMEG_CACHE keyed by
the .bin's path, inode, size, modification and change times and the .idx's content, so a large
dataset is read once, not at every start, and a .bin rewritten in place is counted again even when
its size and mtime were put back (the change time, which no user call can set back, moves with any
write).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from fmeg.data.indexed import DataError, IndexedDataset

# tokens per pass step: 128 MiB of uint16
CHUNK = 1 << 26


def token_range(
    dataset: IndexedDataset, cache_dir: str | os.PathLike | None = None
) -> tuple[int, int] | None:
    """(min id, max id) over every token of the dataset, or None when it holds no tokens."""
    bin_path = Path(dataset.prefix + ".bin").resolve()
    stat = bin_path.stat()
    index = hashlib.sha256(Path(dataset.prefix + ".idx").read_bytes()).hexdigest()
    identity = (
        f"{bin_path}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{index}"
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    cached = Path(cache_dir) / f"token-range-{key}.json" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        try:
            lo, hi = json.loads(cached.read_text())["range"]
            return int(lo), int(hi)
        except (OSError, ValueError, KeyError, TypeError):
            # an unreadable cache entry: count again
            pass
    tokens = dataset.tokens
    if len(tokens) == 0:
        return None
    lo = min(int(tokens[i : i + CHUNK].min()) for i in range(0, len(tokens), CHUNK))
    hi = max(int(tokens[i : i + CHUNK].max()) for i in range(0, len(tokens), CHUNK))
    if cached is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"bin": str(bin_path), "range": [lo, hi]}))
            os.replace(tmp, cached)
        except OSError:
            # a read-only cache directory only costs the pass next time
            pass
    return lo, hi


def check_token_ids(
    dataset: IndexedDataset, vocab_size: int, cache_dir: str | os.PathLike | None = None
) -> None:
    """DataError unless the dataset holds integer token ids that all lie in [0, vocab_size)."""
    if dataset.dtype.kind not in "iu":
        raise DataError(
            f"{dataset.prefix}.idx declares {dataset.dtype} values, not integer token ids; a GPT "
            "trains on token ids: preprocess the text with recipes.preprocess_data"
        )
    found = token_range(dataset, cache_dir)
    if found is None:
        return
    lo, hi = found
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise DataError(
            f"{dataset.prefix}.bin: token id {bad} is outside the tokenizer's vocabulary of "
            f"{vocab_size} ids; preprocess the data with the tokenizer you train with (or give "
            "--tokenizer-type / --vocab-size to match the data)"
        )
