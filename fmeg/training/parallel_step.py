"""One training iteration for any tensor/sequence/pipeline/data-parallel layout.

Parameters live as {stage: this rank's tensor-parallel shard of that stage}; with pp = 1 there is one
stage and the same code runs. An iteration runs this rank's pipeline schedule over its microbatches, sums
the tied-embedding gradients, averages gradients over data parallelism, computes the global gradient norm
(each parameter counted once), clips, and applies AdamW to the local shards. Every rank's shards then hold
exactly the slices of what a single rank would hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg import optim, tree
from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.pipeline import execute, schedules
from fmeg.parallel.sharding import partition_of, shard
from fmeg.parallel.tensor import TensorParallel


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    chunks: int = 1  # virtual pipeline stages per rank
    dp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks


def local_stages(layout: Layout, pp_rank: int) -> list[int]:
    return [s for s in range(layout.num_stages) if s % layout.pp == pp_rank]


def shard_params(full: Any, config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> dict[int, Any]:
    """{stage: tensor-parallel shard} for this rank's stages, cut from the full (single-rank) parameters."""
    stages = gp.split(full, config, layout.pp, layout.chunks)
    coords = {"tp": (mesh.coord("tp"), layout.tp)}
    return {s: shard(stages[s], gpt.TP_RULES, coords) for s in local_stages(layout, mesh.coord("pp"))}


def rank_schedule(layout: Layout, microbatches: int, pp_rank: int):
    if layout.chunks > 1:
        full = schedules.interleaved_1f1b(layout.pp, microbatches, layout.chunks)
    else:
        full = {"1f1b": schedules.one_f_one_b, "gpipe": schedules.gpipe,
                "zero_bubble": schedules.zero_bubble_h1}[layout.schedule](layout.pp, microbatches)
    return schedules.with_communication(full)[pp_rank]


def grad_norm(grads: dict[int, Any], config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> torch.Tensor:
    """The global L2 norm: tensor-parallel shards summed over tp, replicated leaves and the tied output
    copy counted once, stages summed over pp (one all-reduce over the tp-pp group)."""
    total = torch.zeros((), dtype=torch.float64)
    tp_rank, last = mesh.coord("tp"), layout.num_stages - 1
    for stage, g in grads.items():
        for path, leaf in tree.items(g):
            if stage == last and path == "output.weight" and config.tie_embeddings:
                continue  # the copy of the word embedding: its gradient is counted on stage 0
            if partition_of(path, gpt.TP_RULES) is None and tp_rank != 0:
                continue  # replicated over tp: count it on one tensor-parallel rank
            total = total + leaf.double().pow(2).sum()
    group = mesh.group("mp")
    if group is not None:
        total = group.all_reduce(total)
    return total.sqrt()


def train_iteration(params: dict[int, Any], opt_state: Any, microbatches: list[dict], *, config: gpt.GPTConfig,
                    layout: Layout, mesh: Mesh, optimizer: optim.Optimizer, lr: float, weight_decay: float,
                    clip_grad: float) -> tuple[dict[int, Any], Any, dict]:
    tp = TensorParallel(mesh.group("tp"), layout.sequence_parallel)
    fns = {s: gp.stage_fn(config, s, layout.num_stages, tp) for s in params}
    actions = rank_schedule(layout, len(microbatches), mesh.coord("pp"))
    loss, grads = execute.execute(actions, fns, params, microbatches, mesh.group("pp"), layout.num_stages)
    grads = gp.sync_tied_embedding_grads(grads, config, layout.num_stages, mesh.group("embedding"))
    dp_group = mesh.group("dp")
    if dp_group is not None:  # mean over data-parallel replicas (one all-reduce per leaf)
        grads = tree.tree_map(lambda g: dp_group.all_reduce(g) / layout.dp, grads)
        if loss is not None:
            loss = dp_group.all_reduce(loss) / layout.dp
    norm = grad_norm(grads, config, layout, mesh)
    if clip_grad:
        coeff = min(1.0, clip_grad / (float(norm) + 1e-6))
        grads = tree.tree_map(lambda g: g * coeff, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params, lr=torch.tensor(lr),
                                          weight_decay=torch.tensor(weight_decay))
    params = optim.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": float(norm)}
