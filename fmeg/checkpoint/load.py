"""Reading a checkpoint into boxes a rank holds: only the cells that overlap them, each checked by
its crc32.

    ckpt = Checkpoint.open(Path("ck/iter_0000010"))          # metadata.json only; no tensor is read
    # fills out in place
    ckpt.read([Request("mu/layers.0.mlp.fc1.weight", Box((0, 0), (64, 32)), out)])
    # what this process read of the checkpoint
    ckpt.bytes_read

A request names a global tensor, the box of it wanted, and the tensor to fill (any dtype: values are
cast). Every element of the box must come from the checkpoint: a box that no stored piece covers is
a CheckpointError naming the tensor; rows past a vocabulary table's saved rows (pad_with_zeros) are
zeros, as fmeg pads them. Each stored cell is read once (one pread), whatever number of requests it
serves, and never more than one cell is held beyond the requests' own tensors. A damaged file is a
CheckpointError naming the file and the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fmeg.checkpoint import safetensors_file
from fmeg.checkpoint.boxes import Box, Grid
from fmeg.checkpoint.directory import METADATA, CheckpointError
from fmeg.checkpoint.save import cell_name

# metadata.json's "format": cells with crc32s; before it, whole-rank files with sha256 (legacy.py)
FORMAT = 2


@dataclass
class Request:
    name: str
    box: Box
    # shape box.shape; filled in place
    out: torch.Tensor
    # rows past the saved rows of a vocabulary table are zeros
    pad_with_zeros: bool = False


@dataclass(frozen=True)
class Cell:
    """A stored box: a tensor of a file, or a run of elements of one (legacy flat slices)."""

    file: str
    key: str
    box: Box
    crc: int | None
    # the first element of the box in the stored tensor
    start: int = 0


class Entry:
    """One stored piece of a global tensor: its box and the cells of it that one file holds."""

    def __init__(
        self, file: str, name: str, box: Box, steps, cells: tuple[int, int], crcs: list[int]
    ):
        self.file, self.name, self.box, self.grid = (
            file,
            name,
            box,
            Grid(box, tuple(tuple(s) for s in steps)),
        )
        self.first, self.crcs = cells[0], crcs

    def overlapping(self, box: Box) -> list[Cell]:
        out = []
        for i in self.grid.overlapping(box):
            if self.first <= i < self.first + len(self.crcs):
                cell = self.grid.cell(i)
                out.append(
                    Cell(self.file, cell_name(self.name, cell), cell, self.crcs[i - self.first])
                )
        return out


class Checkpoint:
    """One complete checkpoint iteration, opened for reads by box."""

    def __init__(
        self,
        path: Path,
        meta: dict,
        entries: dict[str, list],
        tensors: dict[str, tuple[tuple, str]],
        metadata_bytes: int,
        whole_file_sha256: dict[str, str] | None = None,
    ):
        self.path, self.meta, self.entries, self.tensors = path, meta, entries, tensors
        self._files: dict[str, safetensors_file.SafetensorsFile] = {}
        self._metadata_bytes, self._sha256 = metadata_bytes, whole_file_sha256 or {}
        # the tensors' bytes alone (bytes_read adds the metadata and file headers)
        self.cell_bytes_read = 0

    @classmethod
    def open(cls, path: str | Path) -> "Checkpoint":
        """Read metadata.json (format 2, or an older fmeg's through legacy.py); no tensor is
        read."""
        path = Path(path)
        meta_path = path / METADATA
        try:
            text = meta_path.read_text()
            meta = json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{meta_path}: unreadable ({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
            raise CheckpointError(f"{meta_path}: not an fmeg checkpoint's metadata (no 'files')")
        _check_counters(meta_path, meta)
        if meta.get("format", 1) > FORMAT:
            raise CheckpointError(
                f"{meta_path}: format {meta['format']}, written by a newer fmeg; upgrade fmeg"
            )
        if meta.get("format", 1) < FORMAT:
            from fmeg.checkpoint.legacy import legacy_entries

            entries, tensors, sha256 = legacy_entries(path, meta)
            return cls(path, meta, entries, tensors, len(text), sha256)
        return cls(path, meta, *_entries(meta_path, meta), len(text))

    def has(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self.tensors[name][1])

    @property
    def bytes_read(self) -> int:
        """The bytes this checkpoint made this process read: metadata, file headers and cells."""
        return self._metadata_bytes + sum(f.bytes_read for f in self._files.values())

    def read(self, requests: list[Request]) -> None:
        """Fill every request's out with its box of the checkpoint (see the module's docstring)."""
        plan: dict[Cell, list[tuple[Request, Box]]] = {}
        for r in requests:
            for cell, part in self._cover(r):
                plan.setdefault(cell, []).append((r, part))
        for file in sorted({c.file for c in plan}):
            # in the file's order
            for cell in sorted((c for c in plan if c.file == file), key=self._offset):
                values = self._cell(cell)
                for r, part in plan[cell]:
                    r.out[part.within(r.box)].copy_(values[part.within(cell.box)])

    def _cover(self, r: Request) -> list[tuple[Cell, Box]]:
        if r.name not in self.entries:
            raise CheckpointError(
                f"{self.path}: holds no tensor {r.name} (a checkpoint of another model or kind of "
                "run)"
            )
        saved = Box((0,) * len(self.shape(r.name)), self.shape(r.name))
        if len(saved.shape) != len(r.box.shape):
            raise CheckpointError(
                f"{self.path}: {r.name} has shape {list(saved.shape)} there, but this run's is "
                f"{list(r.box.end)}-dimensional"
            )
        inside = r.box.intersect(saved) if r.box.numel else None
        if (inside.numel if inside else 0) != r.box.numel:
            if not (
                r.pad_with_zeros and all(e <= s for e, s in zip(r.box.end[1:], saved.shape[1:]))
            ):
                raise CheckpointError(
                    f"{self.path}: {r.name} has shape {list(saved.shape)} there, which does not "
                    f"hold this run's block at {list(r.box.offset)} of shape {list(r.box.shape)}"
                )
            # rows past the saved table: padding
            r.out[max(saved.shape[0] - r.box.offset[0], 0) :].zero_()
        if inside is None:
            return []
        out, seen, covered = [], set(), 0
        for entry in self.entries[r.name]:
            if entry.box.intersect(inside) is None:
                continue
            for cell in entry.overlapping(inside):
                # the same cell in another file (a replica an older fmeg wrote)
                if cell.box in seen:
                    continue
                seen.add(cell.box)
                part = cell.box.intersect(inside)
                covered += part.numel
                out.append((cell, part))
        if covered != inside.numel:
            raise CheckpointError(
                f"{self.path}: no stored piece holds all of {r.name} at {list(inside.offset)} "
                f"(shape {list(inside.shape)}); a rank's file is missing from {METADATA}"
            )
        return out

    def _file(self, name: str) -> safetensors_file.SafetensorsFile:
        if name not in self._files:
            self._files[name] = safetensors_file.SafetensorsFile(self.path / name)
            if name in self._sha256:
                self._files[name].check_sha256(self._sha256[name])
        return self._files[name]

    def _offset(self, cell: Cell) -> tuple[int, int]:
        try:
            info = self._file(cell.file).header.get(cell.key)
        except safetensors_file.FileProblem as e:
            raise CheckpointError(str(e)) from None
        return (info["data_offsets"][0] if isinstance(info, dict) else 0), cell.start

    def _cell(self, cell: Cell) -> torch.Tensor:
        """A cell's values, shaped as its box (read and checked)."""
        try:
            raw, dtype, _ = self._file(cell.file).read(
                cell.key, cell.crc, cell.start, cell.box.numel
            )
        except safetensors_file.FileProblem as e:
            raise CheckpointError(str(e)) from None
        self.cell_bytes_read += raw.numel()
        return raw.view(dtype).view(cell.box.shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


COUNTERS = (
    "format",
    "iteration",
    "consumed_samples",
    "valid_consumed_samples",
    "scheduler_steps",
    "world_size",
)


def _check_counters(meta_path: Path, meta: dict) -> None:
    """The counters present are whole numbers >= 0 and the model, layout, arguments and loss scale
    objects, or a CheckpointError (what a run needs of them is policies.resume's to say)."""
    for key in COUNTERS:
        value = meta.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(
                f"{meta_path}: {key} is {value!r}, not a whole number >= 0; the file is damaged: "
                "restore it"
            )
    for key, kinds in (
        ("model", dict),
        ("layout", dict),
        ("arguments", dict),
        ("loss_scale", (dict, type(None))),
    ):
        if not isinstance(meta.get(key, {}), kinds):
            raise CheckpointError(
                f"{meta_path}: {key} is {type(meta[key]).__name__}, not an object; the file is "
                "damaged: restore it"
            )


def _entries(
    meta_path: Path, meta: dict
) -> tuple[dict[str, list[Entry]], dict[str, tuple[tuple, str]]]:
    entries: dict[str, list[Entry]] = {}
    tensors: dict[str, tuple[tuple, str]] = {}
    try:
        for file, info in meta["files"].items():
            for p in info["pieces"]:
                name = p["name"]
                entries.setdefault(name, []).append(
                    Entry(
                        file,
                        name,
                        Box(tuple(p["offset"]), tuple(p["shape"])),
                        p["steps"],
                        tuple(p["cells"]),
                        p["crc32"],
                    )
                )
                tensors[name] = (tuple(p["global_shape"]), p["dtype"])
                if not hasattr(torch, p["dtype"]):
                    raise ValueError(f"unknown dtype {p['dtype']}")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{meta_path}: malformed piece entry ({e}); the file is corrupt"
        ) from None
    return entries, tensors
