"""The training state as boxes of a checkpoint's global tensors: the one model-specific listing of
placements.

    # per leaf: global path, this rank's block, replicas
    places = placements(state, config, layout, mesh)
    # every buffer's values as (kind, box, view)
    boxes = regions(state, places, KINDS)
    # what this rank writes (fmeg.checkpoint.write_rank)
    pieces = save_pieces(boxes, fully_parallel=True)
    # or fills the same views from a checkpoint
    ckpt.read(load_requests(ckpt, boxes))

A leaf of stage s is named by its global path (its layer counted over all stages; the last stage's
copy of the word embedding, gpt_pipeline.embedding_copy, is the embedding itself, held elsewhere and
never written). Its block is where this rank's tensor- and expert-parallel slice sits in the full
tensor (sharding.block_of, the rules shard_params cuts by). The buffers (the compute weights, the
fp32 master weights, Adam's moments) hold each leaf whole or, with the distributed optimizer, a
slice of the flattened leaves: a slice is a few boxes of a leaf's block (boxes.flat_boxes). The
ranks holding the same block in the same kind of buffer are its replicas: the decoder's data- and
context-parallel ranks (and the tensor-parallel ones for a leaf tp does not split), the experts'
expert-data-parallel ranks; a distributed-optimizer slice has replicas only over tp (and hybrid
sharding's instances, which hold the same slices). Replicas write
a block once between them (fully parallel: each its share of the cells; otherwise the first), and
every rank reads exactly the boxes it holds.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from fmeg import tree
from fmeg.checkpoint import Box, Checkpoint, CheckpointError, Piece, Request, cell_steps, flat_boxes
from fmeg.checkpoint.boxes import MAX_CELL_BYTES
from fmeg.checkpoint.save import shares
from fmeg.models import gpt, moe
from fmeg.models import gpt_pipeline as gp
from fmeg.models.vocab import VOCAB_TABLES
from fmeg.parallel.sharding import block_of, partition_of, splits
from fmeg.state.experts import is_expert

# the compute weights, the fp32 master weights, Adam's moments
KINDS = ("params", "main", "mu", "nu")
# the groups holding a state part's whole buffers alike (dense, experts)
REPLICA_GROUPS = ("dp_cp", "expert_dp")


@dataclass(frozen=True)
class Replicas:
    """The ranks holding a block alike: those that differ from this one only on `axes`; this rank is
    the index-th of count."""

    index: int
    count: int
    axes: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    # the global path: "layers.3.attn.qkv.weight"
    name: str
    # this rank's block of the global tensor
    block: Box
    global_shape: tuple[int, ...]
    # the dimensions expert and tensor parallelism split (cells are cut along them)
    split_dims: tuple[int, ...]
    # the ranks holding the block alike in a whole buffer
    whole: "Replicas"
    # the same in a distributed-optimizer slice
    sliced: "Replicas"
    # the last stage's copy of the word embedding: written from stage 0's
    copy: bool = False
    # a vocabulary table: rows past a checkpoint's saved rows are padding (zeros)
    vocab: bool = False


@dataclass(frozen=True)
class Region:
    # which part of the state: 0 the dense leaves, 1 the experts' laid out apart
    part: int
    # "params", "main", "mu" or "nu"
    kind: str
    placement: Placement
    # in the global tensor
    box: Box
    # the buffer's values of the box
    view: torch.Tensor
    # part of a distributed-optimizer slice
    sliced: bool


def _replicas(mesh: Any, axes: list[str]) -> Replicas:
    index, count = 0, 1
    # the first axis varies fastest
    for axis in reversed(axes):
        index, count = index * mesh.size(axis) + mesh.coord(axis), count * mesh.size(axis)
    return Replicas(index, count, tuple(axes))


def placement(
    stage: int, path: str, shape: tuple[int, ...], config: gpt.GPTConfig, layout: Any, mesh: Any
) -> Placement:
    """Where the leaf at path of this rank's stage `stage` sits in the checkpoint's global
    tensors."""
    name = path
    if path.startswith("layers."):
        _, index, rest = path.split(".", 2)
        name = f"layers.{gp.stage_layers(config, stage, layout.stages).start + int(index)}.{rest}"
    copy = stage == layout.num_stages - 1 and path == gp.embedding_copy(config)
    name = "embedding.word.weight" if copy else name
    coords = {"tp": (mesh.coord("tp"), layout.tp), "ep": (mesh.coord("ep"), layout.ep)}
    if layout.experts_apart:
        coords["etp"] = (mesh.coord("expert_tp"), layout.expert_tp)
    rules = gpt.TP_RULES + moe.EP_RULES
    offset, global_shape = block_of(path, shape, rules, coords)
    # what would split it
    split = {axis for axis, *_ in splits(path, rules, {k: (0, 2) for k in coords})}
    parts = [partition_of(path, rules_) for rules_ in (moe.EP_RULES, gpt.TP_RULES)]
    if layout.experts_apart and is_expert(path):
        free = [axis for axis, name_ in (("expert_tp", "etp"), ("ep", "ep")) if name_ not in split]
        # hybrid sharding's instances hold the same slices
        whole, sliced = free + ["expert_dp"], free + ["expert_dp_outer"]
    else:
        free = [] if "tp" in split else ["tp"]
        # hybrid sharding's instances hold the same slices
        whole, sliced = free + ["cp", "dp"], free + ["dp_cp_outer"]
    return Placement(
        name,
        Box(offset, tuple(shape)),
        global_shape,
        tuple(p.dim for p in parts if p),
        _replicas(mesh, whole),
        _replicas(mesh, sliced),
        copy,
        name in VOCAB_TABLES,
    )


def placements(
    state: Any, config: gpt.GPTConfig, layout: Any, mesh: Any
) -> list[list[tuple[int, int, Placement]]]:
    """For each part of the state (the dense leaves; the experts' when laid out apart): (flat start,
    numel, placement) of every leaf, in the part's buffer order."""
    out = []
    for part in state.parts:
        leaves = []
        for path, shape, start in part.leaves():
            stage, _, local = path.partition(".")
            leaves.append(
                (
                    start,
                    math.prod(shape),
                    placement(int(stage), local, tuple(shape), config, layout, mesh),
                )
            )
        out.append(leaves)
    return out


def regions(
    state: Any,
    places: list,
    kinds: tuple[str, ...] = KINDS,
    *,
    buffers: dict | None = None,
    ranges: dict | None = None,
) -> list[Region]:
    """The boxes of the state's buffers of these kinds, each with a view of its values: of the
    state's own buffers, or of buffers[(part, kind)] laid out as them (a host copy); ranges[(part,
    kind)] = (lo, hi) limits a whole buffer to that flat range of the part."""
    out = []
    for p, (part, leaves) in enumerate(zip(state.parts, places)):
        own = part.buffers()
        for kind in kinds:
            if kind not in own:
                continue
            buffer, runs = own[kind]
            buffer = (buffers or {}).get((p, kind), buffer)
            if (p, kind) in (ranges or {}):
                runs = [(*ranges[(p, kind)], ranges[(p, kind)][0])]
            for (lo, hi, first), (start, numel, place) in itertools.product(runs, leaves):
                a, b = max(start, lo), min(start + numel, hi)
                for box, flat in (
                    flat_boxes(place.block.shape, a - start, b - start) if a < b else ()
                ):
                    at = start + flat - lo + first
                    offset = tuple(o + g for o, g in zip(box.offset, place.block.offset))
                    out.append(
                        Region(
                            p,
                            kind,
                            place,
                            Box(offset, box.shape),
                            buffer[at : at + box.numel].view(box.shape),
                            kind in part.sliced_kinds,
                        )
                    )
    return out


def matrix_regions(state: Any, places: list, mesh: Any) -> list[Region]:
    """The per-matrix state of the matrix optimizers (SOAP's factors, bases and moments) this rank
    keeps: each a whole tensor named "matrix/<leaf's global name>.<parameter>.<name>" (an expert's
    parameter counted over all experts), held alike by the ranks that compute the matrix
    (fmeg.state.matrix_step), which write it once between them; any layout reads it whole."""
    out = []
    for p, (part, leaves) in enumerate(zip(state.parts, places)):
        held = part.matrix_states()
        if not held:
            continue
        by_path = {path: place for (path, _, _), (_, _, place) in zip(part.leaves(), leaves)}
        for path, (states, axes) in held.items():
            place = by_path[path]
            first = place.block.offset[0] if ".mlp.experts." in path else 0
            who = _replicas(mesh, axes)
            for i, st in enumerate(states):
                for key, tensor in st.items():
                    shape = tuple(tensor.shape)
                    box = Box((0,) * len(shape), shape)
                    name = f"{place.name}.{first + i}.{key}"
                    at = Placement(name, box, shape, (), who, who)
                    out.append(Region(p, "matrix", at, box, tensor, False))
    return out


def replicas(r: Region) -> Replicas | None:
    """The ranks that hold a region alike and write it between them; None for the tied copy, written
    from the first stage's."""
    return None if r.placement.copy else r.placement.sliced if r.sliced else r.placement.whole


def save_pieces(
    boxes: list[Region], fully_parallel: bool, max_cell: int = MAX_CELL_BYTES
) -> list[Piece]:
    """What this rank writes of its regions: each block once over its replicas; fully parallel, the
    replicas of a kind of block share its cells by bytes (checkpoint.save.shares), otherwise the
    first writes them. max_cell: the cells' size (the same on every rank)."""
    classes: dict[tuple, list[Piece]] = {}
    for r in boxes:
        who = replicas(r)
        if who is None or (who.index and not fully_parallel):
            continue
        steps = cell_steps(
            r.placement.block.shape, r.view.element_size(), r.placement.split_dims, max_cell
        )
        piece = Piece(
            f"{r.kind}/{r.placement.name}", r.box, r.placement.global_shape, r.view, steps
        )
        classes.setdefault((who.axes, who.index, who.count), []).append(piece)
    return [
        p
        for (_, index, count), pieces in classes.items()
        for p in (shares(pieces, index, count) if fully_parallel else pieces)
    ]


def count_piece(count: torch.Tensor) -> Piece:
    """The optimizer's step count (written by rank 0): a copy, since the step counts on in place
    while a background save writes."""
    return Piece("adam/count", Box((), ()), (), count.detach().to("cpu", copy=True).reshape(()), ())


def load_requests(ckpt: Checkpoint, boxes: list[Region]) -> list[Request]:
    """Requests filling the regions from ckpt. The weights come from the saved weights, or from the
    fp32 master when the saved weights are narrower than this run's; the master from the saved
    master, or from the saved weights (a run without one: fp32, or an import)."""
    out = []
    for r in boxes:
        name = r.placement.name
        source = r.kind
        if (
            r.kind == "params"
            and ckpt.has(f"params/{name}")
            and ckpt.has(f"main/{name}")
            and ckpt.dtype(f"params/{name}").itemsize < r.view.element_size()
        ):
            source = "main"
        elif r.kind == "main" and not ckpt.has(f"main/{name}"):
            source = "params"
        if not ckpt.has(f"{source}/{name}"):
            raise CheckpointError(
                f"{ckpt.path}: holds no {source}/{name}; this run's model has a parameter the "
                "checkpoint's has not"
            )
        out.append(Request(f"{source}/{name}", r.box, r.view, pad_with_zeros=r.placement.vocab))
    return out


def held_zeros(
    config: gpt.GPTConfig,
    layout: Any,
    mesh: Any,
    device: Any = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[int, Any]:
    """This rank's {stage: tree} of zeros, shaped as shard_params cuts the model, without building
    the model (a state a checkpoint then fills)."""
    from fmeg.training.parallel_step import local_shapes

    return tree.tree_map(
        lambda t: torch.zeros(t.shape, dtype=dtype, device=device),
        local_shapes(config, layout, mesh),
    )


def read_params(
    ckpt: Checkpoint,
    config: gpt.GPTConfig,
    layout: Any,
    mesh: Any,
    device: Any = "cpu",
    dtype: torch.dtype = torch.float32,
    kind: str = "params",
) -> dict[int, Any]:
    """This rank's {stage: tree} of weights (or of another kind of state: "main", "mu", "nu") in
    dtype, its blocks only read from ckpt (generation, conversion)."""
    held = held_zeros(config, layout, mesh, device, dtype)
    boxes = []
    for stage, stage_tree in held.items():
        for path, leaf in tree.items(stage_tree):
            place = placement(stage, path, tuple(leaf.shape), config, layout, mesh)
            boxes.append(Region(0, kind, place, place.block, leaf, False))
    ckpt.read(load_requests(ckpt, boxes))
    return held


def save_single_rank(
    root: Any, iteration: int, state: Any, config: gpt.GPTConfig, metadata: dict
) -> Any:
    """A one-rank state (fmeg.training.parallel_step.init_state at Layout()) written as a complete
    checkpoint: import-hf's, and tests'."""
    from fmeg.checkpoint import finalize, temporary_dir, write_rank
    from fmeg.checkpoint.load import FORMAT
    from fmeg.parallel.mesh import Mesh
    from fmeg.parallel.layout import Layout

    mesh, layout = Mesh.single(), Layout()
    pieces = save_pieces(regions(state, placements(state, config, layout, mesh)), True)
    tmp = temporary_dir(root, iteration, "0")
    tmp.mkdir(parents=True, exist_ok=True)
    write_rank(tmp, 0, {"tp": 0, "pp": 0, "dp": 0}, pieces + [count_piece(state.parts[0].count)])
    dtype = state.parts[0].weights.dtype
    return finalize(
        root,
        iteration,
        {
            "format": FORMAT,
            "world_size": 1,
            "layout": layout.checkpoint_meta(dtype),
            "consumed_samples": 0,
            "model": config.flat(),
            **metadata,
        },
    )


def saved_count(ckpt: Checkpoint) -> int:
    count = torch.zeros((), dtype=torch.int64)
    ckpt.read([Request("adam/count", Box((), ()), count)])
    return int(count)
