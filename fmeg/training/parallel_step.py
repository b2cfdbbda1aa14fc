"""One training iteration for any tensor/sequence/pipeline/data-parallel layout.

Parameters live as {stage: this rank's tensor-parallel shard of that stage}; with pp = 1 there is one
stage and the same code runs. An iteration runs this rank's pipeline schedule over its microbatches, sums
the tied-embedding gradients, averages gradients over data parallelism, computes the global gradient norm
(each parameter counted once), clips, and applies AdamW to the local shards. Every rank's shards then hold
exactly the slices of what a single rank would hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from fmeg import optim, tree
from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.data_parallel import GradSync
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.pipeline import execute, schedules
from fmeg.parallel.pipeline.segments import subtree
from fmeg.parallel.sharding import partition_of, shard
from fmeg.parallel.tensor import TensorParallel
from fmeg.parallel.zero import FlatBuffer


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


def evaluate(params: dict[int, Any], microbatches: list[dict], *, config: gpt.GPTConfig, layout: Layout,
             mesh: Mesh) -> torch.Tensor | None:
    """Mean loss over microbatches (data-parallel mean), forward only; None off the last stage's ranks."""
    tp = TensorParallel(mesh.group("tp"), layout.sequence_parallel)
    fns = {s: gp.stage_fn(config, s, layout.num_stages, tp) for s in params}
    full = schedules.gpipe(layout.pp, len(microbatches)) if layout.chunks == 1 else \
        schedules.interleaved_1f1b(layout.pp, len(microbatches), layout.chunks, len(microbatches))
    forwards = [[a for a in actions if a.kind == "F"] for actions in full]
    actions = schedules.with_communication(forwards)[mesh.coord("pp")]
    loss, _ = execute.execute(actions, fns, params, microbatches, mesh.group("pp"), layout.num_stages,
                              forward_only=True)
    dp_group = mesh.group("dp")
    if dp_group is not None and loss is not None:
        loss = dp_group.all_reduce(loss) / layout.dp
    return loss


def counted_once(config: gpt.GPTConfig, layout: Layout, mesh: Mesh):
    """keep(path, leaf) for the norm: False for the tied output copy and, off tensor-parallel rank 0, for
    leaves replicated over tp, so that every parameter is counted exactly once."""
    tp_rank, last = mesh.coord("tp"), str(layout.num_stages - 1)

    def keep(path: str, leaf: torch.Tensor) -> bool:
        stage, _, rest = path.partition(".")
        if stage == last and rest == "output.weight" and config.tie_embeddings:
            return False
        return not (partition_of(rest, gpt.TP_RULES) is None and tp_rank != 0)

    return keep


def global_norm(values: dict[int, Any], config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> torch.Tensor:
    """The global L2 norm of this rank's {stage: tree} of gradients or parameters (the same on every
    data-parallel rank): tensor-parallel shards summed over tp, replicated leaves and the tied output copy
    counted once, stages summed over pp (one all-reduce over the tp-pp group)."""
    keep = counted_once(config, layout, mesh)
    total = sum((leaf.double().pow(2).sum() for path, leaf in tree.items(values) if keep(path, leaf)),
                torch.zeros((), dtype=torch.float64))
    group = mesh.group("mp")
    return (group.all_reduce(total) if group is not None else total).sqrt()


@dataclass(frozen=True)
class Zero:
    """What ZeRO-1 fixes at start: the flat layout, this slice's masks, and AdamW with an elementwise
    decay mask. The optimizer state itself stays a pytree of tensors."""

    flat: FlatBuffer
    decay: torch.Tensor  # 1 where weight decay applies, on this rank's slice
    count: torch.Tensor  # 1 where the element counts toward the global gradient norm
    optimizer: optim.Optimizer


def init_state(params: dict[int, Any], config: gpt.GPTConfig, layout: Layout, mesh: Mesh,
               optimizer: optim.Optimizer, *, distributed: bool, compute_dtype: torch.dtype = torch.float32,
               adam: tuple[float, float, float] = (0.9, 0.999, 1e-8)) -> tuple[dict[int, Any], dict, Zero | None]:
    """(model params in the compute dtype, optimizer state, ZeRO context or None) from fp32 params.

    The state holds AdamW's moments ("adam") for all local parameters, or for this data-parallel slice with
    the distributed optimizer (8 / dp bytes per parameter), and, when computing in bf16 / fp16, fp32 main
    weights ("main"): the full local params, or the slice (then 12 / dp bytes per parameter in all)."""
    mixed = compute_dtype != torch.float32
    if distributed:
        flat, rank = FlatBuffer.of(params, layout.dp), mesh.coord("dp")
        decay = flat.shard(flat.mask(params, optim.default_decay_mask), rank)
        count = flat.shard(flat.mask(params, counted_once(config, layout, mesh)), rank)
        zero = Zero(flat, decay, count, optim.adamw(*adam, decay_mask=lambda path, leaf: decay))
        shard = flat.shard(flat.flatten(params), rank).clone()
        state = {"adam": zero.optimizer.init({"shard": shard})}
        if mixed:
            state["main"] = shard
    else:
        zero, state = None, {"adam": optimizer.init(params)}
        if mixed:
            state["main"] = params
    model = tree.tree_map(lambda p: p.to(compute_dtype), params) if mixed else params
    return model, state, zero


def _any_overflow(grads: list[torch.Tensor], mesh: Mesh) -> bool:
    bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()  # one sync, on the device
    for name in ("dp", "mp"):
        group = mesh.group(name)
        bad = group.all_reduce(bad, "max") if group is not None else bad
    return bool(bad > 0)


def tied_paths(config: gpt.GPTConfig, layout: Layout, stages: Any) -> frozenset[str]:
    """The flat paths ("stage.path") of this rank's tied-embedding copies (their gradients are summed over
    the first and last stage after the data-parallel mean)."""
    if not config.tie_embeddings:
        return frozenset()
    last = layout.num_stages - 1
    return frozenset(p for s, p in ((0, "0.embedding.word.weight"), (last, f"{last}.output.weight")) if s in stages)


def _sync_tied(sync: GradSync, config: gpt.GPTConfig, layout: Layout, mesh: Mesh, stages: Any) -> None:
    """Sum the tied copies' (data-parallel mean) gradients in place in the buffer."""
    paths = tied_paths(config, layout, stages)
    if not paths:
        return
    views = sync.tree()
    synced = gp.sync_tied_embedding_grads(views, config, layout.num_stages, mesh.group("embedding"))
    for path in paths:
        stage, _, rest = path.partition(".")
        value = subtree(synced[int(stage)], rest)
        if value is not sync.leaf(path):
            sync.leaf(path).copy_(value)


def _zero_update(params, g_shard, opt_state, zero: Zero, layout, mesh, lr, weight_decay, clip_grad):
    flat, rank, dp_group = zero.flat, mesh.coord("dp"), mesh.group("dp")
    total = (g_shard.double().pow(2) * zero.count).sum()
    for name in ("dp", "mp"):
        group = mesh.group(name)
        total = group.all_reduce(total) if group is not None else total
    norm = total.sqrt()
    if clip_grad:
        g_shard = g_shard * min(1.0, clip_grad / (float(norm) + 1e-6))
    p_shard = opt_state["main"] if "main" in opt_state else flat.shard(flat.flatten(params), rank)
    updates, adam = zero.optimizer.update({"shard": g_shard}, opt_state["adam"], {"shard": p_shard},
                                          lr=torch.tensor(lr), weight_decay=torch.tensor(weight_decay))
    new_shard = p_shard + updates["shard"]
    compute = tree.tree_leaves(params)[0].dtype
    gathered = new_shard.to(compute)
    gathered = dp_group.all_gather(gathered, 0) if dp_group is not None else gathered
    state = {"adam": adam, **({"main": new_shard} if "main" in opt_state else {})}
    return flat.unflatten(gathered, params), state, norm


def train_iteration(params: dict[int, Any], opt_state: dict, microbatches: list[dict], *, config: gpt.GPTConfig,
                    layout: Layout, mesh: Mesh, optimizer: optim.Optimizer, lr: float, weight_decay: float,
                    clip_grad: float, zero: Zero | None = None, loss_scale: float = 1.0,
                    check_overflow: bool = False, overlap_grad_reduce: bool = False,
                    bucket_numel: int | None = None) -> tuple[dict[int, Any], dict, dict]:
    """One step; params are the model's (compute dtype), opt_state comes from init_state. With
    check_overflow (fp16), a step whose gradients hold inf/nan on any rank changes nothing and reports
    skipped=True. overlap_grad_reduce starts each data-parallel bucket's reduction as soon as the backward
    pass has finished its gradients (same numbers; bucket_numel elements per bucket)."""
    t0 = time.perf_counter()
    tp = TensorParallel(mesh.group("tp"), layout.sequence_parallel)
    fns = {s: gp.stage_segments(config, s, layout.num_stages, tp) for s in params}
    actions = rank_schedule(layout, len(microbatches), mesh.coord("pp"))
    sync = GradSync(params, mesh.group("dp"), owner_slices=zero is not None, bucket_numel=bucket_numel,
                    replicated=tied_paths(config, layout, params) if zero is not None else frozenset())
    loss, grads = execute.execute(actions, fns, params, microbatches, mesh.group("pp"), layout.num_stages,
                                  loss_scale=loss_scale, grads_ready=sync.ready if overlap_grad_reduce else None)
    t1 = time.perf_counter()
    for stage, stage_grads in grads.items():  # without overlap: everything now, in the same buckets
        sync.ready(stage, tree.flatten(stage_grads))
    del grads
    sync.finish()  # the data-parallel mean, in the buffer
    _sync_tied(sync, config, layout, mesh, params)
    dp_group = mesh.group("dp")
    if dp_group is not None and loss is not None:
        loss = dp_group.all_reduce(loss) / layout.dp
    if loss_scale != 1.0:
        sync.buffer.div_(loss_scale)
    if zero is not None:  # ZeRO-1: the optimizer needs this rank's slice only
        g_shard = sync.owned()
        held = [g_shard]  # every element is some data-parallel rank's: the overflow check sees them all
    else:
        grads = sync.tree()
        held = [sync.buffer]
    t2 = time.perf_counter()

    def timers(t3: float) -> dict:
        return {"forward-backward": (t1 - t0) * 1e3, "grads-reduce": (t2 - t1) * 1e3, "optimizer": (t3 - t2) * 1e3}

    if check_overflow and _any_overflow(held, mesh):
        return params, opt_state, {"loss": loss, "grad_norm": float("nan"), "skipped": True,
                                   "timers_ms": timers(time.perf_counter())}
    if zero is not None:  # the all-gather of updated slices is timed with the optimizer
        params, opt_state, norm = _zero_update(params, g_shard, opt_state, zero, layout, mesh, lr, weight_decay,
                                               clip_grad)
        return params, opt_state, {"loss": loss, "grad_norm": float(norm), "skipped": False,
                                   "timers_ms": timers(time.perf_counter())}
    norm = global_norm(grads, config, layout, mesh)
    if clip_grad:
        coeff = min(1.0, clip_grad / (float(norm) + 1e-6))
        grads = tree.tree_map(lambda g: g * coeff, grads)
    main = opt_state.get("main", params)
    updates, adam = optimizer.update(grads, opt_state["adam"], main, lr=torch.tensor(lr),
                                     weight_decay=torch.tensor(weight_decay))
    main = optim.apply_updates(main, updates)
    metrics = {"loss": loss, "grad_norm": float(norm), "skipped": False, "timers_ms": timers(time.perf_counter())}
    if "main" in opt_state:
        compute = tree.tree_leaves(params)[0].dtype
        return tree.tree_map(lambda p: p.to(compute), main), {"adam": adam, "main": main}, metrics
    return main, {"adam": adam}, metrics
