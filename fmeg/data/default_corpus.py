"""The embedded default corpus: the .py files of the running Python's standard library, as bytes.

Every machine with Python has them, so the main job trains with no download. The files are tokenized
once (ByteTokenizer: one document per file, ending with the end-of-document token) into an indexed
dataset cached under $FMEG_CACHE (default ~/.cache/fmeg), keyed by the Python version and the file
list.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from fmeg.data.indexed import IndexedDataset, IndexedDatasetBuilder
from fmeg.data.tokenizers import ByteTokenizer


def cache_dir() -> Path:
    return Path(os.environ.get("FMEG_CACHE", Path.home() / ".cache" / "fmeg"))


def stdlib_sources() -> list[Path]:
    """The standard library's .py files in a fixed order (site-packages and bytecode excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    # site-packages pruned, not walked and filtered: it holds many times the standard library's
    # files (torch's among them), and every rank of every run lists the sources for the cache key
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in ("site-packages", "__pycache__")]
        found += [Path(directory, n) for n in names if n.endswith(".py")]
    return sorted(p for p in found if "site-packages" not in p.parts and p.is_file())


def default_corpus(directory: str | os.PathLike | None = None) -> IndexedDataset:
    """The stdlib corpus as an IndexedDataset, built on first use and reused after."""
    files = stdlib_sources()
    if not files:
        raise ValueError(f"no .py files under {sysconfig.get_paths()['stdlib']}; pass --data-path")
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes = [p.stat().st_size for p in files]
    listing = "\n".join(f"{p.relative_to(root)} {n}" for p, n in zip(files, sizes))
    key = hashlib.md5(f"{sys.version}\n{listing}".encode()).hexdigest()[:12]
    directory = Path(directory) if directory is not None else cache_dir()
    prefix = directory / f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    if not (Path(f"{prefix}.idx").is_file() and Path(f"{prefix}.bin").is_file()):
        # the first run pauses here, writing tens of MB under the cache: every rank builds its
        # own copy (renamed into place), the first says what and where
        if os.environ.get("RANK", "0") == "0":
            print(
                f"tokenizing the default corpus once (Python {sys.version_info.major}."
                f"{sys.version_info.minor}'s standard library: {len(files):,} files, "
                f"{sum(sizes) / 1e6:.0f} MB) into {prefix}.bin and .idx; later runs reuse it",
                flush=True,
            )
        directory.mkdir(parents=True, exist_ok=True)
        builder = IndexedDatasetBuilder(f"{prefix}.{os.getpid()}", np.uint16)
        eod = ByteTokenizer.eod
        for path in files:
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)
            builder.add_document(np.append(data, eod))
        builder.finalize()
        # .idx last: a reader never sees an index without its data
        for suffix in (".bin", ".idx"):
            os.replace(f"{prefix}.{os.getpid()}{suffix}", f"{prefix}{suffix}")
    return IndexedDataset(prefix)
