"""The stage functions an iteration runs: the groups the model's transforms talk to, each stage's
segments, and whether they compile as one graph per stage or a piece at a time."""

from __future__ import annotations

import dataclasses
from typing import Any

from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.context import ContextParallel
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh, group_of
from fmeg.parallel.tensor import NO_EP, ExpertParallel, TensorParallel


def model_parallel(
    layout: Layout, mesh: Mesh, fp8: Any = None, exact: bool = False
) -> TensorParallel:
    """The groups the model's transforms talk to: tensor (and sequence) parallelism, and the
    experts' ranks; fp8: the run's fmeg.fp8.plan.Fp8Plan (None: no FP8); exact:
    --deterministic-mode's exact tensor-parallel sums."""
    experts = (
        ExpertParallel(
            mesh.group("tp_ep"),
            mesh.coord("ep"),
            layout.ep,
            mesh.group("expert_tp"),
            mesh.coord("expert_tp"),
            layout.expert_tp,
        )
        if layout.experts_apart
        else NO_EP
    )
    experts = dataclasses.replace(
        experts, balance_group=mesh.group("tp_dp_cp"), **_expert_sources(layout, mesh)
    )
    return TensorParallel(
        mesh.group("tp"),
        layout.sequence_parallel,
        experts,
        ContextParallel(
            mesh.group("cp"), layout.cp_comm_type, mesh.group("cp_a2a"), mesh.group("cp_p2p")
        ),
        fp8_plan=fp8,
        exact=exact,
    )


def _expert_sources(layout: Layout, mesh: Mesh) -> dict[str, Any]:
    """ExpertParallel's FP8 fields: the microbatch of each rank tokens are dispatched over (the
    experts' tp x ep group, or tp's), and whether the ranks splitting one microbatch (tp x cp) all
    send to one holder of an expert; if not, the experts' amaxes join over expert_dp."""
    members = group_of(mesh.groups["tp_ep" if layout.experts_apart else "tp"], mesh.rank)
    members = members or [mesh.rank]
    peers = group_of(mesh.groups["tp_cp"], mesh.rank) or [mesh.rank]
    return {
        "sources": tuple(mesh.coord_of("dp", r) for r in members),
        "microbatch": mesh.coord("dp"),
        "num_sources": layout.dp,
        "amax_group": None if set(peers) <= set(members) else mesh.group("expert_dp"),
    }


def stage_compilation(
    compile: str | None, layout: Layout, overlap_grad_reduce: bool, fp8: Any = None
) -> tuple[str | None, bool]:
    """(the backend the stages compile with, whether each stage is one graph). Delayed FP8 scaling
    compiles only where each stage is one graph and each microbatch's backward follows its forward
    (pp 1): its linears record amaxes into the state in forward and backward, and a compiled
    backward keeps that state from its forward, which no other graph may write in between."""
    fused = (
        compile is not None
        and not (overlap_grad_reduce and layout.dp > 1)
        and (layout.recompute is None or layout.recompute[0] == "selective")
        and layout.sharding != "optim_grads_params"
    )
    delayed = fp8 is not None and fp8.recipe.recipe == "delayed"
    if compile is not None and delayed and not (fused and layout.pp == 1):
        return None, False
    return compile, fused


def stage_functions(
    params: dict,
    config: gpt.GPTConfig,
    layout: Layout,
    mesh: Mesh,
    compile: str | None,
    overlap_grad_reduce: bool,
    per_token: bool,
    fp8: Any = None,
    exact: bool = False,
) -> dict:
    """{stage: its segments}. compile: a torch.compile backend (None: eager). Compiled, each stage
    is one graph (fused), unless its layers' gradients must be handed over one by one (data-parallel
    overlap), whole layers are recomputed or the weights are gathered a unit at a time. exact:
    --deterministic-mode's tensor-parallel sums."""
    tp = model_parallel(layout, mesh, fp8, exact)
    compile, fused = stage_compilation(compile, layout, overlap_grad_reduce, fp8)
    return {
        s: gp.stage_segments(
            config,
            s,
            layout.stages,
            tp,
            layout.recompute,
            compile,
            per_token,
            fused,
            layout.recompute_modules,
        )
        for s in params
    }
