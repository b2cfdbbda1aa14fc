"""A PyTorch distributed checkpoint directory (Megatron's torch_dist format), read by box.

    ck = TorchDistDir(Path("ck/iter_0000100"))       # reads .metadata only
    # (num_layers, hidden, ffn): layers stacked first
    ck.shape("decoder.layers.mlp.linear_fc2.weight")
    ck.read([("decoder.layers.mlp.linear_fc2.weight", Box((3, 0, 0), (1, 64, 128)), out)])

The directory holds `.metadata` (every tensor's global shape, dtype and chunks: the boxes Megatron's
ranks saved, and where each lies: file, offset, length) and `__R_K.distcp` files of chunks, each a
torch.save'd tensor (read with weights_only=True). A read takes only the chunks that overlap the
boxes asked for, each once, and copies the overlaps. Of a chunk only part of which is needed, only
the run of whole rows that holds the part is read, where its archive's directory and data.pkl
(safe_pickle.saved_tensor) place it; otherwise the whole chunk, loaded and checked by torch.load. A
tensor no chunk covers, a file that ends early or a chunk that does not load is a
MegatronCheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fmeg.checkpoint.boxes import Box
from fmeg.interop.megatron.safe_pickle import (
    MegatronCheckpointError,
    read_dcp_metadata,
    read_object,
    saved_tensor,
)


@dataclass(frozen=True)
class Chunk:
    key: str
    box: Box
    file: str
    offset: int
    length: int


class TorchDistDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        metadata = read_dcp_metadata(self.path / ".metadata")
        where = {}
        # Megatron's ShardedObjects (torch.save'd bytes): "<key>/shard_<offset>_<count>"
        self.objects: dict[str, Any] = {}
        for index, info in metadata.storage_data.items():
            if index.offset is not None:
                where[(index.fqn, tuple(index.offset))] = info
            else:
                self.objects[index.fqn] = info
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.chunks: dict[str, list[Chunk]] = {}
        for key, md in metadata.state_dict_metadata.items():
            # bytes: Megatron's extra state, RNG states, ...
            if not hasattr(md, "chunks"):
                continue
            self.tensors[key] = (tuple(md.size), md.properties.dtype)
            for chunk in md.chunks:
                info = where.get((key, tuple(chunk.offsets)))
                if info is None:
                    raise MegatronCheckpointError(
                        f"{self.path / '.metadata'}: lists a chunk of {key} at "
                        f"{list(chunk.offsets)} but not where it is stored; the file is damaged"
                    )
                if getattr(info, "transform_descriptors", None):
                    raise MegatronCheckpointError(
                        f"{self.path / info.relative_path}: {key} is stored transformed "
                        f"({info.transform_descriptors}); save the checkpoint without compression "
                        "to load it in fmeg"
                    )
                box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                self.chunks.setdefault(key, []).append(
                    Chunk(key, box, info.relative_path, info.offset, info.length)
                )
        self.bytes_read = (self.path / ".metadata").stat().st_size
        # the .distcp files a read has touched
        self.files_read: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key][1]

    def read_object(self, key: str) -> Any:
        """A ShardedObject's value (through the inert unpickler), or None where none is saved."""
        info = self.objects.get(key)
        if info is None:
            return None
        chunk = Chunk(key, Box((0,), (info.length,)), info.relative_path, info.offset, info.length)
        raw = self._pread(chunk, info.length, info.offset)
        return read_object(raw, f"{self.path / info.relative_path} ({key})")

    def covers(self, key: str, box: Box) -> bool:
        """Whether the saved chunks of key hold all of box (a sparse stacked tensor: MoE and dense
        layers)."""
        return (
            sum(p.numel for c in self.chunks.get(key, ()) if (p := c.box.intersect(box)))
            == box.numel
        )

    def read(self, wanted: list[tuple[str, Box, torch.Tensor]]) -> None:
        """Fill each (key, box, out) with that box of the global tensor key; each chunk is read
        once."""
        plan: dict[Chunk, list[tuple[Box, Box, torch.Tensor]]] = {}
        for key, box, out in wanted:
            covered = 0
            for chunk in self.chunks.get(key, ()):
                part = chunk.box.intersect(box)
                if part is not None:
                    plan.setdefault(chunk, []).append((part, box, out))
                    covered += part.numel
            if covered != box.numel:
                raise MegatronCheckpointError(
                    f"{self.path}: no saved chunk holds all of {key} at {list(box.offset)} (shape "
                    f"{list(box.shape)}); a rank's file is missing or the model differs"
                )
        for chunk in sorted(plan, key=lambda c: (c.file, c.offset)):
            region = rows_needed(chunk.box, [part for part, _, _ in plan[chunk]])
            values = self._load_rows(chunk, region) if region != chunk.box else None
            if values is None:
                region, values = chunk.box, self._load(chunk)
            for part, box, out in plan[chunk]:
                out[part.within(box)].copy_(values[part.within(region)])

    def _pread(self, chunk: Chunk, length: int, offset: int) -> bytes:
        file = self.path / chunk.file
        try:
            with open(file, "rb") as f:
                raw = os.pread(f.fileno(), length, offset)
        except OSError as e:
            raise MegatronCheckpointError(f"{file}: unreadable ({e}); it holds {chunk.key}")
        self.bytes_read += len(raw)
        self.files_read.add(chunk.file)
        return raw

    def _load_rows(self, chunk: Chunk, region: Box) -> torch.Tensor | None:
        """region (a run of whole rows of the chunk: contiguous bytes) read alone, or None where the
        chunk's layout is not the plain one this needs (then the whole chunk is read and
        checked)."""
        try:
            start, dtype = self._elements_start(chunk)
        except (ValueError, KeyError, zipfile.BadZipFile, struct.error):
            return None
        k = next(d for d in range(len(region.shape)) if region.shape[d] != chunk.box.shape[d])
        inner = math.prod(chunk.box.shape[k + 1 :])
        size = dtype.itemsize
        first = (region.offset[k] - chunk.box.offset[k]) * inner
        raw = self._pread(chunk, region.numel * size, start + first * size)
        if len(raw) != region.numel * size:
            # a truncated file: the whole read names it
            return None
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(region.shape)

    def _elements_start(self, chunk: Chunk) -> tuple[int, torch.dtype]:
        """The file offset of the chunk's first element, and the dtype, from its torch.save
        archive's directory and data.pkl (a few hundred bytes), or of a raw chunk."""
        dtype = self.dtype(chunk.key)
        if self._pread(chunk, 2, chunk.offset) != b"PK":
            if chunk.length != chunk.box.numel * dtype.itemsize:
                raise ValueError("not a raw chunk")
            return chunk.offset, dtype
        window = _Window(self, chunk)
        archive = zipfile.ZipFile(window)
        # "data.pkl", "byteorder", "data/0": the records of archive/..., whatever the prefix
        names = {}
        for info in archive.infolist():
            path = info.filename.split("/")
            names["/".join(path[-2:]) if path[-2:-1] == ["data"] else path[-1]] = info
        if any(info.compress_type for info in names.values()):
            raise ValueError("compressed")
        if "byteorder" in names and archive.read(names["byteorder"]) != b"little":
            raise ValueError("big-endian")
        layout = saved_tensor(archive.read(names["data.pkl"]))
        strides = tuple(math.prod(chunk.box.shape[d + 1 :]) for d in range(len(chunk.box.shape)))
        contiguous = chunk.box.numel <= 1 or layout.stride == strides
        if layout.size != chunk.box.shape or layout.dtype != dtype or not contiguous:
            raise ValueError("not the chunk's tensor, contiguous")
        data = names[f"data/{layout.storage}"]
        if data.file_size < (layout.offset + chunk.box.numel) * dtype.itemsize:
            raise ValueError("a storage shorter than the tensor")
        header = self._pread(chunk, 30, chunk.offset + data.header_offset)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        # the storage's bytes in the archive
        first = data.header_offset + 30 + name_length + extra_length
        return chunk.offset + first + layout.offset * dtype.itemsize, dtype

    def _load(self, chunk: Chunk) -> torch.Tensor:
        file = self.path / chunk.file
        raw = self._pread(chunk, chunk.length, chunk.offset)
        if len(raw) != chunk.length:
            raise MegatronCheckpointError(
                f"{file}: ends at byte {chunk.offset + len(raw)}, before the end of {chunk.key}'s "
                f"chunk (byte {chunk.offset + chunk.length}); the file is truncated"
            )
        try:
            # torch.save's archive (Megatron writes every chunk so)
            if raw[:2] == b"PK":
                archive = io.BytesIO(raw)
                values = torch.load(archive, map_location="cpu", weights_only=True)
            else:
                dtype = self.dtype(chunk.key)
                values = torch.frombuffer(bytearray(raw), dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a damaged archive fails in many types
            raise MegatronCheckpointError(
                f"{file}: {chunk.key}'s chunk at byte {chunk.offset} does not load "
                f"({type(e).__name__}); the file is damaged"
            )
        if not isinstance(values, torch.Tensor) or values.numel() != chunk.box.numel:
            raise MegatronCheckpointError(
                f"{file}: {chunk.key}'s chunk at byte {chunk.offset} is not the "
                f"{list(chunk.box.shape)} tensor .metadata says; the file is damaged"
            )
        return values.reshape(chunk.box.shape)


def rows_needed(chunk: Box, parts: list[Box]) -> Box:
    """The least run of whole rows of `chunk` (contiguous in its bytes) that holds every part: the
    parts' bounding box in the first dimension they do not span, everything after it whole; the
    whole chunk where the dimensions before that one are not single."""
    low = [min(p.offset[d] for p in parts) for d in range(len(chunk.shape))]
    high = [max(p.end[d] for p in parts) for d in range(len(chunk.shape))]
    for k in range(len(chunk.shape)):
        if (low[k], high[k]) != (chunk.offset[k], chunk.end[k]):
            if any(chunk.shape[d] != 1 for d in range(k)):
                return chunk
            return Box(
                (*chunk.offset[:k], low[k], *chunk.offset[k + 1 :]),
                (*chunk.shape[:k], high[k] - low[k], *chunk.shape[k + 1 :]),
            )
    return chunk


class _Window(io.RawIOBase):
    """One chunk's bytes of a file as a seekable file (for zipfile's reading of its directory), each
    read a pread counted in the reader's bytes_read."""

    def __init__(self, reader: TorchDistDir, chunk: Chunk):
        self.reader, self.chunk, self.position = reader, chunk, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: 0, 1: self.position, 2: self.chunk.length}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.chunk.length - self.position))
        raw = self.reader._pread(self.chunk, n, self.chunk.offset + self.position) if n else b""
        buffer[: len(raw)] = raw
        self.position += len(raw)
        return len(raw)
