"""A model's training curve at a layout, on ranks in one process (threads) or on gloo processes:
the property behind fmeg's headline guarantee, for a test or a notebook.

    want = layout_curve_on(Layout(), config, microbatches, iterations=3)
    got = layout_curve_on(Layout(tp=2, pp=2), config, microbatches, iterations=3)
    assert_same_curve(got, want)

Each step is the runner's (fmeg.training.parallel_step.train_iteration) on the state the runner
builds, from gpt.init(config, seed) cut for each rank; each data-parallel rank takes its
microbatches of the global batch as the runner deals them, and each context-parallel rank its
tokens of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from fmeg.fp8.delayed import DelayedState
from fmeg.fp8.plan import Fp8Plan
from fmeg.models import gpt
from fmeg.parallel.context import shard_batch
from fmeg.parallel.layout import Layout
from fmeg.parallel.spmd import GlooRanks, run_threads
from fmeg.training.parallel_step import initialized_state, train_iteration
from fmeg.training.stage_functions import model_parallel
from fmeg.training.step_settings import StepSettings


def mesh_sizes(layout: Layout) -> dict[str, int]:
    """The mesh's group sizes of a layout (its world: tp x pp x cp x dp)."""
    return dict(
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.expert_tp,
        cp_a2a=layout.cp_a2a,
    )


def world_of(layout: Layout) -> int:
    return layout.tp * layout.pp * layout.cp * layout.dp


def layout_curve(
    mesh: Any,
    config: gpt.GPTConfig,
    layout: Layout,
    microbatches: list[dict],
    iterations: int,
    lr: float = 1e-2,
    seed: int = 0,
    fp8: Fp8Plan | None = None,
) -> dict[str, Any]:
    """This rank's program: {"losses", "grad_norms"} of `iterations` steps (the losses None on
    ranks without the last pipeline stage) and its state's "bytes_per_parameter". Module level,
    so gloo ranks can import it. fp8: an FP8 plan (delayed scaling's state made here, one per
    rank)."""
    state = initialized_state(config, layout, mesh, seed=seed, device="cpu")
    context = model_parallel(layout, mesh).context
    dp, rank = layout.dp, mesh.coord("dp")
    mine = [shard_batch(mb, context) for mb in microbatches[rank::dp]]
    if fp8 is not None and fp8.recipe.recipe == "delayed":
        layers = config.num_layers + config.mtp_depth
        experts = config.experts.num_experts if config.experts else 0
        delayed = DelayedState(
            layers, fp8.recipe.history_len, grad_factor=layout.dp, num_experts=experts
        )
        fp8 = dataclasses.replace(fp8, state=delayed)
    settings = StepSettings(lr=lr, weight_decay=0.01, clip_grad=1.0, fp8=fp8)
    losses, norms = [], []
    for _ in range(iterations):
        m = train_iteration(state, mine, config=config, layout=layout, mesh=mesh, settings=settings)
        losses.append(None if m["loss"] is None else float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return {
        "losses": losses,
        "grad_norms": norms,
        "bytes_per_parameter": state.bytes_per_parameter(),
    }


def layout_curve_on(
    layout: Layout,
    config: gpt.GPTConfig,
    microbatches: list[dict],
    iterations: int,
    *,
    backend: str = "threads",
    timeout: float = 300.0,
    fp8: Fp8Plan | None = None,
) -> dict[str, Any]:
    """The curve of config at layout over every rank: the losses of a last-stage rank, the grad
    norms (every rank's the same), and each rank's bytes per parameter. microbatches: the global
    batch's, layout.micro_batch_size rows each, dealt to the data-parallel ranks. fp8: the FP8
    plan the layers run with (fmeg.fp8.plan.Fp8Plan)."""
    world = world_of(layout)
    args = (config, layout, microbatches, iterations, 1e-2, 0, fp8)
    seq = layout.sequence_parallel
    if backend == "threads":
        per_rank = run_threads(
            world, layout_curve, *args, timeout=timeout, sequence_parallel=seq, **mesh_sizes(layout)
        )
    else:
        with GlooRanks(world, timeout=timeout) as ranks:
            per_rank = ranks.run(layout_curve, *args, sequence_parallel=seq, **mesh_sizes(layout))
    losses = next(r["losses"] for r in per_rank if r["losses"][0] is not None)
    return {
        "losses": losses,
        "grad_norms": per_rank[0]["grad_norms"],
        "bytes_per_parameter": [r["bytes_per_parameter"] for r in per_rank],
    }


def random_microbatches(
    config: gpt.GPTConfig, count: int, rows: int = 2, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """count microbatches of rows x config.max_seq_len uniform random tokens (labels: the next
    token; every position counted), for a curve of a small model."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = torch.randint(0, config.vocab_size, (rows, config.max_seq_len + 1), generator=gen)
        mask = torch.ones(rows, config.max_seq_len)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask})
    return out


def largest_difference(got: dict, want: dict) -> float:
    """The largest relative difference of the losses and grad norms of two curves (inf where
    either curve's value is not finite). ValueError naming both lengths if the curves differ in
    length, or naming the key if one lacks "losses" or "grad_norms"."""
    problem = _unlike(got, want)
    if problem:
        raise ValueError(problem)
    return max(
        (
            abs(g - w) / (abs(w) or 1.0) if math.isfinite(g) and math.isfinite(w) else math.inf
            for key in ("losses", "grad_norms")
            for g, w in zip(got[key], want[key])
        ),
        default=0.0,
    )


def assert_same_curve(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Raise AssertionError naming the difference unless got's curve is want's within rtol: the
    same number of losses and of grad norms, each within rtol relative of want's (a value that is
    not finite on either side differs). Raised explicitly, so it holds under python -O."""
    problem = _unlike(got, want)
    if problem:
        raise AssertionError(problem)
    worst = largest_difference(got, want)
    if not worst <= rtol:
        raise AssertionError(
            f"the curves differ by {worst:.3g} (relative), beyond {rtol:g}: losses "
            f"{got['losses']} against {want['losses']}, grad norms {got['grad_norms']} against "
            f"{want['grad_norms']}"
        )


def _unlike(got: dict, want: dict) -> str:
    """Why two curves cannot be compared value by value, or ""."""
    for key in ("losses", "grad_norms"):
        for side, curve in (("got", got), ("want", want)):
            if key not in curve:
                return f"the curves cannot be compared: {side} has no {key!r}"
        if len(got[key]) != len(want[key]):
            return (
                f"the curves differ in length: got has {len(got[key])} {key}, want has "
                f"{len(want[key])}"
            )
    return ""
