"""Writing one rank's part of a checkpoint: pieces (boxes of global tensors) cut into cells, one
file per rank.

    piece = Piece("mu/layers.0.mlp.fc1.weight", Box((64, 0), (64, 32)), (128, 32), values, steps,
        share=(1, 2))
    # rank_00003.safetensors and .json
    entry = write_rank(tmp_dir, rank=3, coords={...}, pieces=[...])

A piece is a box that this rank holds. It is cut into cells (boxes.Grid); each cell is one tensor of
the file, named by its place in the global tensor ("mu/layers.0.mlp.fc1.weight[64:72,0:32]"), with a
crc32 in the rank's JSON. cells = (first, stop) writes only those cells: the ranks holding the same
boxes (replicas) write each cell once between them, spread over them (Megatron's fully parallel
save: shares), or all on one of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fmeg.checkpoint import safetensors_file
from fmeg.checkpoint.boxes import Box, Grid


@dataclass(frozen=True)
class Piece:
    # "params/layers.0.attn.qkv.weight": the kind of state, then the global path
    name: str
    # where values sit in the global tensor
    box: Box
    global_shape: tuple[int, ...]
    # the box's values (host memory), shape box.shape
    values: torch.Tensor
    # boxes.cell_steps of the leaf's block: the cells' cut points
    steps: tuple[tuple[int, ...], ...]
    # the range of cells (in boxes.Grid's order) written here; None: all
    cells: tuple[int, int] | None = None


def shares(pieces: list[Piece], index: int, count: int) -> list[Piece]:
    """The part of pieces (held alike by count replicas) that replica `index` writes: the pieces'
    cells in order, cut into count runs of about equal bytes, the index-th run."""
    starts, at = [], 0
    for p in pieces:
        grid, itemsize = Grid(p.box, p.steps), p.values.element_size()
        starts.append([])
        for i in range(len(grid)):
            starts[-1].append(at)
            at += grid.cell(i).numel * itemsize
    lo, hi, out = at * index // count, at * (index + 1) // count, []
    for p, cell_starts in zip(pieces, starts):
        mine = [i for i, start in enumerate(cell_starts) if lo <= start < hi]
        if mine:
            out.append(dataclasses.replace(p, cells=(mine[0], mine[-1] + 1)))
    return out


def cell_name(name: str, cell: Box) -> str:
    return f"{name}[{cell.key()}]"


def write_rank(
    directory: str | os.PathLike, rank: int, coords: dict[str, int], pieces: list[Piece]
) -> dict:
    """Write this rank's cells of pieces as rank_XXXXX.safetensors and its entry (coords, and for
    each piece written: name, global shape, dtype, box, cut steps, the range of cells written and
    their crc32) as rank_XXXXX.json, both fsynced; returns the entry."""
    directory = Path(directory)
    cells, entries = [], []
    for p in pieces:
        grid = Grid(p.box, p.steps)
        mine = range(*(p.cells or (0, len(grid))))
        if not mine:
            continue
        names = [cell_name(p.name, grid.cell(i)) for i in mine]
        cells += [(n, p.values[grid.cell(i).within(p.box)]) for n, i in zip(names, mine)]
        entries.append(
            {
                "name": p.name,
                "global_shape": list(p.global_shape),
                "dtype": str(p.values.dtype).removeprefix("torch."),
                "offset": list(p.box.offset),
                "shape": list(p.box.shape),
                "steps": [list(s) for s in p.steps],
                "cells": [mine.start, mine.stop],
                "keys": names,
            }
        )
    crcs = safetensors_file.write(directory / f"rank_{rank:05d}.safetensors", cells)
    for e in entries:
        e["crc32"] = [crcs[n] for n in e.pop("keys")]
    entry = {"rank": rank, "coords": coords, "pieces": entries}
    path = directory / f"rank_{rank:05d}.json"
    with open(path, "w") as f:
        json.dump(entry, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    return entry
