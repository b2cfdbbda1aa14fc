"""Megatron's indexed dataset format (.bin/.idx), read memory-mapped and written atomically.

    prefix.bin  the tokens of every sequence, back to back, in one integer dtype
    prefix.idx
        b"MMIDIDX\\x00\\x00", <Q version 1, <B dtype code, <Q sequence count, <Q document count,
                int32 sequence lengths, int64 sequence byte offsets into .bin, int64 document
                    indices
                (0 first; each document end appends the running sequence count)

A document is one or more sequences (usually one). Files written here are read by megatron-core's
IndexedDataset and files written by its IndexedDatasetBuilder are read here. Every malformed input
fails with one line naming the file.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")


def best_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (Megatron: vocab below 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


class DataError(ValueError):
    """A malformed or missing data file; the message names the file."""


def _check_layout(
    idx_path: Path, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray, itemsize: int
) -> None:
    """Sequences back to back from byte 0, and document boundaries that rise from 0 to the sequence
    count, as Megatron's builder writes them; anything else is a corrupt index."""
    if (lengths < 0).any():
        raise DataError(f"{idx_path}: a negative sequence length; the index is corrupt")
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=starts[1:])
    if not np.array_equal(pointers, starts):
        raise DataError(
            f"{idx_path}: sequence offsets do not follow the sequence lengths; the index is corrupt"
        )
    if (
        len(documents) == 0
        or documents[0] != 0
        or documents[-1] != len(lengths)
        or (np.diff(documents) < 0).any()
    ):
        raise DataError(
            f"{idx_path}: document boundaries do not rise from 0 to the {len(lengths)} sequences; "
            "the index is corrupt"
        )


class IndexedDataset:
    """Sequences of a .bin/.idx pair, memory-mapped (slices are views, no copies)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataError(
                    f"{path}: no such file (expected the {path.suffix} half of dataset "
                    f"{self.prefix})"
                )
        raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
        if len(raw) < _HEADER.size:
            raise DataError(
                f"{idx_path}: {len(raw)} bytes is shorter than the {_HEADER.size}-byte header"
            )
        magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(raw[: _HEADER.size]))
        if magic != MAGIC:
            raise DataError(
                f"{idx_path}: not a Megatron index (header {magic!r}, expected {MAGIC!r})"
            )
        if version != VERSION:
            raise DataError(
                f"{idx_path}: index version {version}, only version {VERSION} is supported"
            )
        if code not in DTYPES:
            raise DataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
        expected = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(raw) != expected:
            raise DataError(
                f"{idx_path}: {len(raw)} bytes, but its header describes {expected} ({n_seq} "
                f"sequences, {n_doc} document entries); the file is truncated or corrupt"
            )
        offset = _HEADER.size
        self.dtype = np.dtype(DTYPES[code])
        self.sequence_lengths = np.frombuffer(raw, np.int32, n_seq, offset)
        self.sequence_pointers = np.frombuffer(raw, np.int64, n_seq, offset + 4 * n_seq)
        self.document_indices = np.frombuffer(raw, np.int64, n_doc, offset + 12 * n_seq)
        bin_bytes = bin_path.stat().st_size
        needed = (
            int(self.sequence_pointers[-1] + self.sequence_lengths[-1] * self.dtype.itemsize)
            if n_seq
            else 0
        )
        if bin_bytes < needed:
            raise DataError(
                f"{bin_path}: {bin_bytes} bytes, but {idx_path.name} needs {needed}; the .bin is "
                "truncated"
            )
        if bin_bytes > needed:
            raise DataError(
                f"{bin_path}: {bin_bytes} bytes, but {idx_path.name} describes only {needed}; the "
                "index is stale or belongs to another .bin (write both again with "
                "recipes.preprocess_data)"
            )
        _check_layout(
            idx_path,
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
            self.dtype.itemsize,
        )
        self._bin = (
            np.memmap(bin_path, dtype=self.dtype, mode="r")
            if bin_bytes
            else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset .. offset + length of sequence i (a view into the memory map)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        n = int(self.sequence_lengths[i]) - offset if length is None else length
        return self._bin[start : start + n]

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the file in order (the memory map itself, no copy)."""
        return self._bin

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDatasetBuilder:
    """Appends sequences and documents, then finalize() writes prefix.bin and prefix.idx.

    Both files are written under temporary names and renamed only when complete, so an interrupted
    build never leaves a pair that reads as valid.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type = np.int32):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in CODES:
            raise DataError(
                f"{self.prefix}: dtype {self.dtype} has no Megatron code "
                f"({sorted(map(str, CODES))})"
            )
        self._tmp_bin = self.prefix + ".bin.tmp"
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """One sequence of the current document."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """A whole document: one sequence, or several given their lengths."""
        arr = np.asarray(tokens, dtype=self.dtype)
        for part in np.split(arr, np.cumsum(lengths)[:-1]) if lengths else [arr]:
            self.add_item(part)
        self.end_document()

    def add_index(self, other_prefix: str | os.PathLike) -> None:
        """Append every document of another dataset of the same dtype (merging shards)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{other.prefix}.idx: dtype {other.dtype} differs from this builder's {self.dtype}"
            )
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + base).tolist())
        self._bin.write(np.asarray(other.tokens).tobytes())

    def abort(self) -> None:
        """Stop without writing a dataset: the partial files are removed (also after a failed
        write)."""
        try:
            self._bin.close()
        # a full disk fails the last flush too
        except OSError:
            pass
        for path in (self._tmp_bin, self.prefix + ".idx.tmp"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def finalize(self) -> None:
        """Write the index and rename both files into place; on any failure, nothing is left
        behind."""
        try:
            self._finalize()
        except OSError:
            self.abort()
            raise

    def _finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        tmp_idx = self.prefix + ".idx.tmp"
        with open(tmp_idx, "wb") as f:
            f.write(
                _HEADER.pack(
                    MAGIC, VERSION, CODES[self.dtype], len(lengths), len(self.document_indices)
                )
            )
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes())
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")
