"""Checkpoints of fmeg before format 2 (to 2026-11-24), read as boxes like any other.

Their rank files hold params/<stage>/<path> (a rank's tensor- and expert-parallel block, with its
global shape and offset in the rank's JSON) and, with the distributed optimizer, flat slices
(mu/shard, nu/shard, main/shard; the experts' own in */expert_shard) of the rank's flattened blocks
in pytree order, whose leaves the rank's "names" list in order. Each piece of a slice is a run of
elements of the stored slice (load.Cell.start). These files carry a sha256 each and no per-tensor
checksums: a file is checked whole the first time it is read.
"""

from __future__ import annotations

import math
from pathlib import Path

from fmeg.checkpoint.boxes import Box, flat_boxes
from fmeg.checkpoint.directory import METADATA, CheckpointError


class LegacyEntry:
    """One stored box: a whole tensor of a file, or a run of elements of a flat slice."""

    def __init__(self, cell):
        self.box, self.cell = cell.box, cell

    def overlapping(self, box: Box) -> list:
        return [self.cell] if self.box.intersect(box) is not None else []


def _global_path(stage_path: str, model: dict, stages: int) -> str | None:
    """layers.i.rest of stage s -> layers.(s * L / S + i).rest; None for the tied copy of the word
    embedding."""
    stage, _, path = stage_path.partition("/")
    s = int(stage)
    if path.startswith("layers."):
        _, index, rest = path.split(".", 2)
        return f"layers.{s * model['num_layers'] // stages + int(index)}.{rest}"
    if path == "output.weight" and model.get("tie_embeddings", True):
        return None
    return path


def legacy_entries(path: Path, meta: dict):
    """({name: [LegacyEntry]}, {name: (global shape, dtype)}) of a format-1 checkpoint."""
    from fmeg.checkpoint.load import Cell

    try:
        layout, model = meta["layout"], meta["model"]
        stages = layout["pp"] * layout.get("chunks", 1)
        apart = "ep" in layout
        entries: dict[str, list] = {}
        tensors: dict[str, tuple[tuple, str]] = {}
        # (owner coords, stage path) -> the params block's description
        blocks: dict[tuple, dict] = {}

        def add(name: str, cell) -> None:
            entries.setdefault(name, []).append(LegacyEntry(cell))

        for file, info in meta["files"].items():
            for name, d in info["tensors"].items():
                kind, _, stage_path = name.partition("/")
                if kind == "adam":
                    add(name, Cell(file, name, Box((), ()), None))
                    tensors[name] = ((), d["dtype"])
                    continue
                if stage_path in ("shard", "expert_shard"):
                    continue
                # the tied copy's too: the flat slices hold it
                if kind == "params":
                    blocks[(_owner(info["coords"], _is_expert(stage_path), apart), stage_path)] = d
                leaf = _global_path(stage_path, model, stages)
                if leaf is None:
                    continue
                add(
                    f"{kind}/{leaf}",
                    Cell(file, name, Box(tuple(d["offset"]), tuple(d["local_shape"])), None),
                )
                tensors[f"{kind}/{leaf}"] = (tuple(d["global_shape"]), d["dtype"])
        for file, info in meta["files"].items():
            for name, d in info["tensors"].items():
                kind, _, which = name.partition("/")
                if which not in ("shard", "expert_shard"):
                    continue
                experts = which == "expert_shard"
                leaves = [
                    n.partition("/")[2]
                    for n in info["names"]
                    if n.startswith("params/")
                    and (not apart or _is_expert(n.partition("/")[2]) == experts)
                ]
                start, length = d["offset"][0], d["local_shape"][0]
                owner = _owner(info["coords"], experts, apart)
                at = 0
                for stage_path in leaves:
                    block = blocks[(owner, stage_path)]
                    n = math.prod(block["local_shape"])
                    a, b = max(at, start), min(at + n, start + length)
                    leaf = _global_path(stage_path, model, stages)
                    if a < b and leaf is not None:
                        for box, flat in flat_boxes(tuple(block["local_shape"]), a - at, b - at):
                            global_box = Box(
                                tuple(o + g for o, g in zip(box.offset, block["offset"])), box.shape
                            )
                            add(
                                f"{kind}/{leaf}",
                                Cell(file, name, global_box, None, at + flat - start),
                            )
                        tensors[f"{kind}/{leaf}"] = (tuple(block["global_shape"]), "float32")
                    at += n
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"{path / METADATA}: an older fmeg's metadata that cannot be read ({e!r})"
        ) from None
    return entries, tensors, {file: info["sha256"] for file, info in meta["files"].items()}


def _is_expert(stage_path: str) -> bool:
    return ".mlp.experts." in "." + stage_path.partition("/")[2]


def _owner(coords: dict, expert: bool, apart: bool) -> tuple:
    """The coordinates of the rank that wrote the params block a rank at coords holds (the first
    data-parallel rank holding it: older fmeg wrote each block once)."""
    if expert and apart:
        return ("expert", coords["pp"], coords["ep"], coords["etp"])
    return ("dense", coords["tp"], coords["pp"])
