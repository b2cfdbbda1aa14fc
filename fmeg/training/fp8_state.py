"""Delayed FP8 scaling's state in a run (fmeg.fp8.delayed): made with the training state, saved
whole by rank 0 beside Adam's count, read by every rank at any layout."""

from __future__ import annotations

import torch

from fmeg import checkpoint
from fmeg.checkpoint.boxes import Box
from fmeg.checkpoint.load import Request
from fmeg.checkpoint.save import Piece
from fmeg.fp8.delayed import SITES, DelayedState
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
    return state


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
