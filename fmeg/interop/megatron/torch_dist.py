"""A PyTorch distributed checkpoint directory (Megatron's torch_dist format), read by box.

    ck = TorchDistDir(Path("ck/iter_0000100"))       # reads .metadata only
    ck.shape("decoder.layers.mlp.linear_fc2.weight")  # (num_layers, hidden, ffn): layers stacked first
    ck.read([("decoder.layers.mlp.linear_fc2.weight", Box((3, 0, 0), (1, 64, 128)), out)])

The directory holds `.metadata` (every tensor's global shape, dtype and chunks: the boxes Megatron's ranks
saved, and where each lies: file, offset, length) and `__R_K.distcp` files of chunks, each a torch.save'd
tensor (read with weights_only=True). A read takes only the chunks that overlap the boxes asked for, each once,
and copies the overlaps; a tensor no chunk covers, a file that ends early or a chunk that does not load is a
MegatronCheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fmeg.checkpoint.boxes import Box
from fmeg.interop.megatron.safe_pickle import MegatronCheckpointError, read_dcp_metadata


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
        for index, info in metadata.storage_data.items():
            if index.offset is not None:
                where[(index.fqn, tuple(index.offset))] = info
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.chunks: dict[str, list[Chunk]] = {}
        for key, md in metadata.state_dict_metadata.items():
            if not hasattr(md, "chunks"):  # bytes: Megatron's extra state, RNG states, ...
                continue
            self.tensors[key] = (tuple(md.size), md.properties.dtype)
            for chunk in md.chunks:
                info = where.get((key, tuple(chunk.offsets)))
                if info is None:
                    raise MegatronCheckpointError(f"{self.path / '.metadata'}: lists a chunk of {key} at "
                                                  f"{list(chunk.offsets)} but not where it is stored; the file is "
                                                  "damaged")
                if getattr(info, "transform_descriptors", None):
                    raise MegatronCheckpointError(
                        f"{self.path / info.relative_path}: {key} is stored transformed "
                        f"({info.transform_descriptors}); save the checkpoint without compression to load it in fmeg")
                box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                self.chunks.setdefault(key, []).append(Chunk(key, box, info.relative_path, info.offset, info.length))
        self.bytes_read = (self.path / ".metadata").stat().st_size

    def has(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key][1]

    def covers(self, key: str, box: Box) -> bool:
        """Whether the saved chunks of key hold all of box (a sparse stacked tensor: MoE and dense layers)."""
        return sum(p.numel for c in self.chunks.get(key, ()) if (p := c.box.intersect(box))) == box.numel

    def read(self, wanted: list[tuple[str, Box, torch.Tensor]]) -> None:
        """Fill each (key, box, out) with that box of the global tensor key; each chunk is read once."""
        plan: dict[Chunk, list[tuple[Box, Box, torch.Tensor]]] = {}
        for key, box, out in wanted:
            covered = 0
            for chunk in self.chunks.get(key, ()):
                part = chunk.box.intersect(box)
                if part is not None:
                    plan.setdefault(chunk, []).append((part, box, out))
                    covered += part.numel
            if covered != box.numel:
                raise MegatronCheckpointError(f"{self.path}: no saved chunk holds all of {key} at {list(box.offset)} "
                                              f"(shape {list(box.shape)}); a rank's file is missing or the model "
                                              "differs")
        for chunk in sorted(plan, key=lambda c: (c.file, c.offset)):
            values = self._load(chunk)
            for part, box, out in plan[chunk]:
                out[part.within(box)].copy_(values[part.within(chunk.box)])

    def _load(self, chunk: Chunk) -> torch.Tensor:
        file = self.path / chunk.file
        try:
            with open(file, "rb") as f:
                raw = os.pread(f.fileno(), chunk.length, chunk.offset)
        except OSError as e:
            raise MegatronCheckpointError(f"{file}: unreadable ({e}); it holds {chunk.key}")
        self.bytes_read += len(raw)
        if len(raw) != chunk.length:
            raise MegatronCheckpointError(f"{file}: ends at byte {chunk.offset + len(raw)}, before the end of "
                                          f"{chunk.key}'s chunk (byte {chunk.offset + chunk.length}); the file is "
                                          "truncated")
        try:
            if raw[:2] == b"PK":  # torch.save's archive (Megatron writes every chunk so)
                archive = io.BytesIO(raw)
                values = torch.load(archive, map_location="cpu", weights_only=True)
            else:
                dtype = self.dtype(chunk.key)
                values = torch.frombuffer(bytearray(raw), dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a damaged archive fails in many types
            raise MegatronCheckpointError(f"{file}: {chunk.key}'s chunk at byte {chunk.offset} does not load "
                                          f"({type(e).__name__}); the file is damaged")
        if not isinstance(values, torch.Tensor) or values.numel() != chunk.box.numel:
            raise MegatronCheckpointError(f"{file}: {chunk.key}'s chunk at byte {chunk.offset} is not the "
                                          f"{list(chunk.box.shape)} tensor .metadata says; the file is damaged")
        return values.reshape(chunk.box.shape)
