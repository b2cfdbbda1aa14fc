"""Delayed FP8 scaling's state in a run (fmeg.fp8.delayed): made with the training state, saved
whole by rank 0 beside Adam's count, read by every rank at any layout."""

from __future__ import annotations

import torch

from fmeg import checkpoint
from fmeg.checkpoint.boxes import Box
from fmeg.checkpoint.load import Request
from fmeg.checkpoint.save import Piece
from fmeg.fp8.delayed import SITES, DelayedState
from fmeg.fp8.grouped import EXPERT_RECIPES
from fmeg.fp8.param_gather import Fp8ParamGather, Fp8Piece
from fmeg.models import gpt_pipeline as gp
from fmeg.state.flat import FlatState


def with_fp8_state(state: FlatState, cfg, session) -> FlatState:
    """state with .fp8: delayed scaling's amax history and scales (fmeg.fp8.delayed), fresh, or
    None without delayed scaling. Part of the training state: saved whole by rank 0, read by
    every rank, the same at any layout."""
    plan = cfg.precision.fp8
    state.fp8 = (
        DelayedState(
            cfg.model.num_layers + cfg.model.mtp_depth,
            plan.recipe.history_len,
            session.device,
            1 if cfg.training.per_token_loss else cfg.layout.dp,
            cfg.model.experts.num_experts if cfg.model.experts else 0,
        )
        if plan is not None and plan.recipe.recipe == "delayed"
        else None
    )
    if plan is not None and plan.param_gather and gathers_fp8(cfg.layout):
        attach_fp8_gather(state, cfg, session)
    return state


# the FP8 linears' weights by their path's end, and their linear (fmeg.fp8.delayed.SITES)
WEIGHT_SITES = {
    "attn.qkv.weight": "qkv",
    "attn.proj.weight": "proj",
    "mlp.fc1.weight": "fc1",
    "mlp.fc2.weight": "fc2",
    "mlp.shared.fc1.weight": "fc1",
    "mlp.shared.fc2.weight": "fc2",
    "mlp.experts.fc1.weight": "fc1",
    "mlp.experts.fc2.weight": "fc2",
}


def gathers_fp8(layout) -> bool:
    """--fp8-param-gather moves FP8 bytes where weights are all-gathered: by the distributed
    optimizer after its step, or by Megatron-FSDP before each use."""
    return layout.sharding in ("optim", "optim_grads", "optim_grads_params")


def keeps_fp32_master(layout) -> bool:
    """The distributed optimizer's gather writes FP8 numbers into the weights it steps from in
    fp32: the master is kept apart (Megatron-FSDP gathers into buffers of their own)."""
    return layout.sharding in ("optim", "optim_grads")


def fp8_weight_pieces(part, cfg, plan, delayed, ep_rank: int) -> list[Fp8Piece]:
    """The flat ranges of part's FP8 weights, each with one scale: a dense linear's weight, or
    one expert's matrix of an experts' weight (fmeg.fp8.grouped)."""
    pieces = []
    for (path, (start, numel)), shape in zip(part.leaf_ranges.items(), part.flat.shapes):
        names = path.split(".")
        site = next((v for k, v in WEIGHT_SITES.items() if path.endswith("." + k)), None)
        if site is None or names[1] != "layers":
            continue
        layer = gp.stage_layers(cfg.model, int(names[0]), cfg.layout.stages)[int(names[2])]
        if not plan.covers(layer):
            continue
        if ".mlp.experts." not in path:
            row = delayed.row(layer, site) if delayed else None
            pieces.append(Fp8Piece(start, numel, row))
            continue
        if plan.recipe.recipe not in EXPERT_RECIPES:
            continue
        held, each = shape[0], numel // max(shape[0], 1)
        for e in range(held):
            row = delayed.expert_row(layer, ep_rank * held + e, site) if delayed else None
            pieces.append(Fp8Piece(start + e * each, each, row))
    return pieces


def attach_fp8_gather(state, cfg, session) -> None:
    """Each part of state gathers its FP8 weights as FP8 bytes (fmeg.fp8.param_gather); delayed
    scaling's weight amaxes are then recorded from the owned chunks, not in the forward."""
    plan, mesh, delayed = cfg.precision.fp8, session.mesh, state.fp8
    for part in state.parts:
        experts = part is getattr(state, "experts", None)
        pieces = fp8_weight_pieces(part, cfg, plan, delayed, mesh.coord("ep") if experts else 0)
        names = ("expert_dp_shard", "expert_tp") if experts else ("dp_cp_shard", "tp")
        part.fp8_gather = Fp8ParamGather(
            pieces,
            part.flat.units,
            part.flat.chunk_starts,
            part.dp,
            part.dp_rank,
            part.weights.dtype,
            plan.recipe,
            tuple(mesh.group(n) for n in names),
            part.weights.device,
            delayed,
        )
        if part.gathered is not None:
            part.gathered.fp8 = part.fp8_gather
        if delayed is not None:
            rows = {p.row for p in pieces}
            delayed.weights_recorded = delayed.weights_recorded | frozenset(rows)


def record_fp8_weights(state) -> None:
    """--fp8-param-gather at a step's start: delayed scaling's weight amaxes from the owned chunks;
    under Megatron-FSDP the scales its gathers quantize with this step."""
    for part in getattr(state, "parts", ()):
        gather = getattr(part, "fp8_gather", None)
        if gather is not None:
            gather.record(part.master)
            if part.gathered is not None:
                gather.prepare(part.master)


FP8_PIECES = ("history", "scale")


def fp8_pieces(state) -> list:
    """The delayed-scaling state as checkpoint pieces (rank 0 writes them): copies, since the next
    step renews it in place while a background save writes."""
    if getattr(state, "fp8", None) is None:
        return []
    out = []
    for name in FP8_PIECES:
        t = getattr(state.fp8, name).detach().to("cpu", copy=True)
        box = Box((0,) * t.dim(), tuple(t.shape))
        out.append(Piece(f"fp8/{name}", box, tuple(t.shape), t, tuple(() for _ in t.shape)))
    return out


def read_fp8(ckpt, state) -> None:
    """The saved amax history and scales into state.fp8, when the checkpoint has them (else they
    start fresh, as a run without delayed scaling left none); a history of another length, or
    another model's rows, is refused in one line. A state saved before the experts had rows
    gives the layers theirs, and the experts' start fresh."""
    if getattr(state, "fp8", None) is None or not ckpt.has("fp8/history"):
        return
    saved, mine = ckpt.shape("fp8/history"), tuple(state.fp8.history.shape)
    if saved[0] != mine[0]:
        raise checkpoint.CheckpointError(
            f"{ckpt.path}: its FP8 amax history is {saved[0]} iterations long and this run's "
            f"--fp8-amax-history-len is {mine[0]}; give --fp8-amax-history-len {saved[0]}"
        )
    dense = state.fp8.num_layers * len(SITES)
    if saved[1] != mine[1] and saved[1] != dense:
        raise checkpoint.CheckpointError(
            f"{ckpt.path}: its FP8 amax history has {saved[1]} rows and this model's {mine[1]}: "
            "it was saved by a model with other layers or experts"
        )
    for name in FP8_PIECES:
        t = getattr(state.fp8, name)
        # saved before the experts' rows existed: theirs start fresh
        shape = (*t.shape[:-2], saved[1], t.shape[-1])
        out = torch.empty(shape, dtype=t.dtype)
        ckpt.read([Request(f"fp8/{name}", Box((0,) * t.dim(), shape), out)])
        t[..., : saved[1], :].copy_(out)
