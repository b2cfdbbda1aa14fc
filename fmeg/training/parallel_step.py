"""One training iteration for any tensor/sequence/pipeline/data-parallel layout.

Parameters live as {stage: this rank's tensor-parallel shard of that stage}; with pp = 1 there is one
stage and the same code runs. An iteration runs this rank's pipeline schedule over its microbatches, sums
the tied-embedding gradients, averages gradients over data parallelism, computes the global gradient norm
(each parameter counted once), clips, and applies AdamW to the local shards, in place in the buffers of a
FlatState. Every rank's shards then hold exactly the slices of what a single rank would hold.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from fmeg import optim, tree
from fmeg.models import gpt, moe
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.pipeline import execute, schedules
from fmeg.parallel.pipeline.segments import subtree
from fmeg.parallel.sharding import partition_of, shard
from fmeg.parallel.context import ContextParallel
from fmeg.parallel.tensor import NO_EP, ExpertParallel, TensorParallel
from fmeg.state.flat import FlatState


def local_stages(layout: Layout, pp_rank: int) -> list[int]:
    return [s for s in range(layout.num_stages) if s % layout.pp == pp_rank]


def shard_params(full: Any, config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> dict[int, Any]:
    """{stage: tensor- (and expert-) parallel shard} for this rank's stages, cut from the full (single-rank)
    parameters."""
    stages = gp.split(full, config, layout.pp, layout.chunks)
    coords = {"tp": (mesh.coord("tp"), layout.tp), "ep": (mesh.coord("ep"), layout.ep)}
    if layout.experts_apart:
        coords["etp"] = (mesh.coord("expert_tp"), layout.expert_tp)
    return {s: shard(stages[s], gpt.TP_RULES + moe.EP_RULES, coords) for s in local_stages(layout, mesh.coord("pp"))}


def model_parallel(layout: Layout, mesh: Mesh) -> TensorParallel:
    """The groups the model's transforms talk to: tensor (and sequence) parallelism, and the experts' ranks."""
    experts = ExpertParallel(mesh.group("tp_ep"), mesh.coord("ep"), layout.ep, mesh.group("expert_tp"),
                             mesh.coord("expert_tp"), layout.expert_tp) if layout.experts_apart else NO_EP
    experts = dataclasses.replace(experts, balance_group=mesh.group("tp_dp_cp"))
    return TensorParallel(mesh.group("tp"), layout.sequence_parallel, experts,
                          ContextParallel(mesh.group("cp"), layout.cp_comm_type, mesh.group("cp_a2a"),
                                          mesh.group("cp_p2p")))


def rank_schedule(layout: Layout, microbatches: int, pp_rank: int):
    if layout.chunks > 1:
        full = schedules.interleaved_1f1b(layout.pp, microbatches, layout.chunks)
    else:
        full = {"1f1b": schedules.one_f_one_b, "gpipe": schedules.gpipe,
                "zero_bubble": schedules.zero_bubble_h1}[layout.schedule](layout.pp, microbatches)
    return schedules.with_communication(full)[pp_rank]


def evaluate(params: dict[int, Any], microbatches: list[dict], *, config: gpt.GPTConfig, layout: Layout,
             mesh: Mesh, compile: str | None = None, use: Any = None) -> torch.Tensor | None:
    """[sum of the token losses, number of tokens] over the microbatches and data parallelism, forward only;
    None off the last stage's ranks. Validation divides the sums over all its batches, as Megatron reports
    its validation loss: a mean over tokens, whatever the loss masks. use: the state's use (sharded weights)."""
    tp = model_parallel(layout, mesh)
    fns = {s: gp.stage_segments(config, s, layout.num_stages, tp, compile=compile, per_token=True,
                                fused=compile is not None) for s in params}
    full = schedules.gpipe(layout.pp, len(microbatches)) if layout.chunks == 1 else \
        schedules.interleaved_1f1b(layout.pp, len(microbatches), layout.chunks, len(microbatches))
    forwards = [[a for a in actions if a.kind == "F"] for actions in full]
    actions = schedules.with_communication(forwards)[mesh.coord("pp")]
    loss, _ = execute.execute(actions, fns, params, microbatches, mesh.group("pp"), layout.num_stages,
                              forward_only=True, microbatch_mean=False, **({"use": use} if use else {}))
    if loss is None:
        return None
    tokens = sum(gpt.loss_tokens(mb) for mb in microbatches).to(loss.device)
    pair = torch.stack([loss.double(), tokens.double()])
    group = mesh.group("dp_cp")  # every rank's tokens: data and context parallel
    return group.all_reduce(pair) if group is not None else pair


def counted_once(config: gpt.GPTConfig, layout: Layout, mesh: Mesh):
    """keep(path, leaf) for the norm: False for the tied output copy and, off tensor-parallel rank 0, for
    leaves replicated over tp, so that every parameter is counted exactly once."""
    from fmeg.state.experts import is_expert

    tp_rank, expert_tp_rank, last = mesh.coord("tp"), mesh.coord("expert_tp"), str(layout.num_stages - 1)
    copy = gp.embedding_copy(config)

    def keep(path: str, leaf: torch.Tensor) -> bool:
        stage, _, rest = path.partition(".")
        if stage == last and rest == copy:
            return False
        rank = expert_tp_rank if layout.experts_apart and is_expert(rest) else tp_rank
        return not (partition_of(rest, gpt.TP_RULES) is None and rank != 0)

    return keep


def global_norm(values: dict[int, Any], config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> torch.Tensor:
    """The global L2 norm of this rank's {stage: tree} of gradients or parameters (the same on every
    data-parallel rank): tensor-parallel shards summed over tp, replicated leaves and the tied output copy
    counted once, stages summed over pp (one all-reduce over the tp-pp group); under expert parallelism the
    experts' squares are summed over tp x ep x pp instead."""
    from fmeg.state.experts import is_expert

    keep = counted_once(config, layout, mesh)
    dense = experts = torch.zeros((), dtype=torch.float64)
    for path, leaf in tree.items(values):
        if keep(path, leaf):
            if layout.experts_apart and is_expert(path):
                experts = experts + leaf.double().pow(2).sum()
            else:
                dense = dense + leaf.double().pow(2).sum()
    group = mesh.group("mp")
    total = group.all_reduce(dense) if group is not None else dense
    if layout.experts_apart:
        group = mesh.group("tp_ep_pp")
        total = total + (group.all_reduce(experts) if group is not None else experts)
    return total.sqrt()


def init_state(params: dict[int, Any], config: gpt.GPTConfig, layout: Layout, mesh: Mesh, *,
               compute_dtype: torch.dtype = torch.float32,
               adam: tuple[float, float, float] = (0.9, 0.999, 1e-8),
               grad_dtype: torch.dtype = torch.float32, device: Any = None,
               reshard_after_forward: str = "true",
               moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)) -> FlatState:
    """This rank's training state from its fp32 params ({stage: tree}, or their shapes as meta tensors with the
    device to hold the state on: state.assign() or a checkpoint then fills it): the model's weights in the compute
    dtype, fp32 master weights when computing in bf16 / fp16, and AdamW's moments, for all local
    parameters or, with the distributed optimizer, this data-parallel slice (fmeg.state.flat).
    Gradients are accumulated and reduced in grad_dtype (bf16: Megatron's --grad-reduce-in-bf16), Adam's moments
    stored in moment_dtypes (Megatron's precision-aware optimizer: bf16, stepped in fp32). Under expert
    parallelism the experts' leaves have a state of their own (fmeg.state.experts)."""
    b1, b2, eps = adam
    options = dict(compute_dtype=compute_dtype, grad_dtype=grad_dtype, device=device,
                   reshard_after_forward=reshard_after_forward,
                   optimizer=optim.adamw(b1, b2, eps, moment_dtypes=moment_dtypes,
                                         decoupled=embedding_or_output(layout)))
    if layout.experts_apart:
        from fmeg.state.experts import ExpertSplitState

        return ExpertSplitState(params, counted_once(config, layout, mesh), mesh, sharding=layout.sharding,
                                dp=layout.dp, **options)
    return FlatState(params, counted_once(config, layout, mesh), sharding=layout.sharding, dp=mesh.size("dp_cp"),
                     dp_rank=mesh.coord("dp_cp"), dp_group=mesh.group("dp_cp"), **options)


def local_shapes(config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> dict[int, Any]:
    """This rank's {stage: tree} as shard_params cuts the model, as meta tensors: shapes only, nothing stored."""
    with torch.device("meta"):
        return shard_params(gpt.init(config, 0, device="meta"), config, layout, mesh)


def initialized_state(config: gpt.GPTConfig, layout: Layout, mesh: Mesh, *, seed: int, **options: Any) -> FlatState:
    """init_state of this rank's shard of gpt.init(config, seed), bitwise, built a unit (a layer, the embedding,
    the head) at a time, as Megatron's --init-model-with-meta-device builds it: each unit of this rank's stages is
    drawn whole in fp32, cut to this rank's shard and copied into the state (with sharded weights, the slice held
    here only), so no rank ever holds more of the model at once than its state and one unit. options: init_state's
    (device: where the state lives)."""
    state = init_state(local_shapes(config, layout, mesh), config, layout, mesh, **options)
    for stage in local_stages(layout, mesh.coord("pp")):
        for unit in gp.stage_units(config, stage, layout.num_stages):
            state.assign(shard_params(gpt.init(config, seed, only=unit), config, layout, mesh))
    return state


def embedding_or_output(layout: Layout):
    """decoupled(path, leaf): the word embedding and the output layer (the copies of the embedding included), the
    leaves Megatron's --decoupled-lr applies to."""
    last = str(layout.num_stages - 1)

    def decoupled(path: str, leaf: torch.Tensor) -> bool:
        stage, _, rest = path.partition(".")
        return rest == "embedding.word.weight" or (stage == last and rest in ("output.weight", "mtp_embedding.weight"))

    return decoupled


def _non_finite(grads: list[torch.Tensor], loss: torch.Tensor | None, mesh: Mesh) -> tuple[bool, bool]:
    """(any rank's gradient holds inf/nan, the loss is inf/nan where it is held): one all-reduce of two flags,
    one host sync."""
    device = grads[0].device
    bad_loss = (~torch.isfinite(loss)).any() if loss is not None else torch.zeros((), dtype=torch.bool, device=device)
    bad_grad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
    flags = torch.stack([bad_grad, bad_loss.to(device)]).float()
    for name in ("dp_cp", "mp"):
        group = mesh.group(name)
        flags = group.all_reduce(flags, "max") if group is not None else flags
    overflow, loss_bad = flags.tolist()
    return overflow > 0, loss_bad > 0


def tied_paths(config: gpt.GPTConfig, layout: Layout, stages: Any) -> frozenset[str]:
    """The flat paths ("stage.path") of this rank's copies of the word embedding (their gradients are summed over
    the first and last stage after the data-parallel mean): gpt_pipeline.embedding_copy."""
    copy = gp.embedding_copy(config)
    if copy is None:
        return frozenset()
    last = layout.num_stages - 1
    return frozenset(p for s, p in ((0, "0.embedding.word.weight"), (last, f"{last}.{copy}")) if s in stages)


def _sync_tied(sync: Any, config: gpt.GPTConfig, layout: Layout, mesh: Mesh, stages: Any) -> None:
    """Sum the tied copies' (data-parallel mean) gradients in place in the sync's whole views of them."""
    paths = tied_paths(config, layout, stages)
    if not paths:
        return
    held: dict[int, Any] = {}
    for path in paths:  # {stage: {"embedding": {"word": {"weight": g}}} or {"output" / "mtp_embedding": {"weight": g}}}
        stage, _, rest = path.partition(".")
        node = held.setdefault(int(stage), {})
        *parents, name = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = sync.leaf(path)
    synced = gp.sync_tied_embedding_grads(held, config, layout.num_stages, mesh.group("embedding"))
    for path in paths:
        stage, _, rest = path.partition(".")
        value = subtree(synced[int(stage)], rest)
        if value is not sync.leaf(path):
            sync.leaf(path).copy_(value)


def with_aux_losses(microbatches: list[dict], config: gpt.GPTConfig, loss_scale: float, per_token: bool,
                    cp: int = 1, cp_group: Any = None) -> tuple[list[dict], tuple[torch.Tensor, torch.Tensor | None]]:
    """For a mixture of experts, the microbatches (copies) with what their auxiliary losses need: loss_seed, the
    backward seed of their sum (loss scale / microbatches; with per-token losses, loss scale times the number of
    the microbatch's tokens, loss-masked or not, as megatron-core's router scales them: each of the cp ranks
    holding 1/cp of them seeds its part of the balance losses with the whole microbatch's count, so the curve is
    one rank's; with a padding_mask, its unpadded tokens, summed over cp_group, as megatron-core's router counts
    them), and moe_metrics, this microbatch's row of a
    [microbatches, layers, len(moe.METRICS)] buffer (returned) the layers write their values into, and with
    the expert bias moe_counts, its row of a [microbatches, layers, experts] buffer of tokens per expert (layers:
    the decoder's, then the multi-token prediction layers')."""
    device, layers = microbatches[0]["tokens"].device, len(moe.moe_layers(config, mtp=True))
    metrics = torch.zeros(len(microbatches), layers, len(moe.METRICS), device=device)
    counts = torch.zeros(len(microbatches), layers, config.num_experts, device=device) \
        if config.moe_router_enable_expert_bias else None
    m = len(microbatches)
    global_counts = torch.zeros(m, layers, config.num_experts, device=device) \
        if config.moe_router_load_balancing_type == "global_aux_loss" else None
    out = []
    for i, mb in enumerate(microbatches):
        # per-token: megatron-core's router scales its aux losses by the tokens it routed, all of the microbatch's
        # (the loss mask does not enter), which the division by the global batch's loss tokens then cancels
        seed = torch.tensor(loss_scale * (mb["tokens"].numel() * cp if per_token else 1.0 / len(microbatches)),
                            device=device)
        if per_token and mb.get("padding_mask") is not None:
            unpadded = (~mb["padding_mask"].bool()).sum().to(device=device, dtype=seed.dtype)
            seed = loss_scale * (cp_group.all_reduce(unpadded) if cp_group is not None else unpadded)
        step = {}
        if global_counts is not None:  # microbatch i writes row i and averages rows 0..i
            order = torch.arange(m, device=device)
            step = {"moe_global_counts": global_counts, "moe_one_hot": (order == i).float(),
                    "moe_seen": (order <= i).float()}
        out.append({**mb, "loss_seed": seed, "moe_metrics": metrics[i],
                    **({"moe_counts": counts[i]} if counts is not None else {}), **step})
    return out, (metrics, counts)


def update_expert_bias(state: Any, counts: torch.Tensor, config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> None:
    """Megatron's aux-loss-free balancing after a step: each MoE layer's expert_bias += rate * sign(mean load -
    load), the loads being the tokens each expert received over the step's microbatches and every rank."""
    total = counts.sum(dim=0)
    for name in ("tp_dp_cp", "pp"):
        group = mesh.group(name)
        total = group.all_reduce(total) if group is not None else total
    delta = config.moe_router_bias_update_rate * torch.sign(total.mean(dim=-1, keepdim=True) - total)
    kinds = moe.moe_layers(config, mtp=True)
    for stage in state.params:
        for j, index in enumerate(gp.stage_layers(config, stage, layout.num_stages)):
            if kinds[index]:
                state.add_(f"{stage}.layers.{j}.mlp.router.expert_bias", delta[index])
        if stage == layout.num_stages - 1:  # the multi-token prediction layers'
            for k in range(config.mtp_num_layers or 0):
                if kinds[config.num_layers + k]:
                    state.add_(f"{stage}.mtp.{k}.layer.mlp.router.expert_bias", delta[config.num_layers + k])


def aux_loss_values(metrics: torch.Tensor | None, config: gpt.GPTConfig, layout: Layout, mesh: Mesh,
                    per_layer_out: dict | None = None) -> dict:
    """{Megatron's name: device tensor} of the auxiliary losses in use, as Megatron logs them: each layer's
    value averaged over microbatches and data parallelism, then over the MoE layers, the multi-token prediction
    layers' included (parts under sequence parallelism and the layers of other pipeline stages summed over the
    tp-pp group first). per_layer_out, when given, receives each MoE layer's value as megatron-core's
    --moe-per-layer-logging names it ("load_balancing_loss_layer_3", layers counted from 0 as in its tracker)."""
    if metrics is None:
        return {}
    per_layer = metrics.mean(dim=0)
    for name in ("mp", "dp", "cp"):  # parts over tp (sp) and cp sum to a microbatch's value
        group = mesh.group(name)
        if group is not None:
            per_layer = group.all_reduce(per_layer)
    kind = config.moe_router_load_balancing_type
    used = {"load_balancing_loss": config.moe_aux_loss_coeff > 0 and kind in ("aux_loss", "seq_aux_loss"),
            "z_loss": bool(config.moe_z_loss_coeff),
            "global_load_balancing_loss": config.moe_aux_loss_coeff > 0 and kind == "global_aux_loss"}
    # the global loss's parts sum over every data rank to the batch's loss; the others are data-parallel means
    per_layer = per_layer * torch.tensor([1.0 / layout.dp, 1.0 / layout.dp, 1.0], device=per_layer.device) \
        if used["global_load_balancing_loss"] else per_layer / layout.dp
    if kind == "seq_aux_loss":  # megatron-core's name for the sequence-level loss
        used = {("seq_load_balancing_loss" if k == "load_balancing_loss" else k): v for k, v in used.items()}
    moe_indices = [i for i, is_moe in enumerate(moe.moe_layers(config, mtp=True)) if is_moe]
    mean = per_layer[moe_indices].mean(dim=0)
    if per_layer_out is not None:
        per_layer_out |= {f"{name}_layer_{index}": per_layer[index, i] for index in moe_indices
                          for i, name in enumerate(used) if used[name]}
    return {name: mean[i] for i, name in enumerate(used) if used[name]}


def with_mtp_metrics(microbatches: list[dict], config: gpt.GPTConfig) -> tuple[list[dict], torch.Tensor | None]:
    """For multi-token prediction layers, the microbatches (copies) with mtp_metrics, their row of a
    [microbatches, depths] buffer (returned) the last stage writes each depth's loss into (fmeg.models.mtp)."""
    if not config.mtp_num_layers:
        return microbatches, None
    metrics = torch.zeros(len(microbatches), config.mtp_num_layers, device=microbatches[0]["tokens"].device)
    return [{**mb, "mtp_metrics": metrics[i]} for i, mb in enumerate(microbatches)], metrics


def mtp_loss_values(metrics: torch.Tensor | None, layout: Layout, mesh: Mesh) -> dict:
    """{"mtp_1 loss": device tensor, ...}: each depth's loss as megatron-core logs it, averaged over microbatches and
    data parallelism (each cp rank holds its share; other pipeline stages hold zeros)."""
    if metrics is None:
        return {}
    per_depth = metrics.mean(dim=0)
    for name in ("cp", "dp", "pp"):
        group = mesh.group(name)
        if group is not None:
            per_depth = group.all_reduce(per_depth)
    per_depth = per_depth / layout.dp
    return {f"mtp_{k + 1} loss": per_depth[k] for k in range(per_depth.shape[0])}


def train_iteration(state: FlatState, microbatches: list[dict], *, config: gpt.GPTConfig, layout: Layout,
                    mesh: Mesh, lr: float, weight_decay: float, clip_grad: float, loss_scale: float = 1.0,
                    check_overflow: bool = False, overlap_grad_reduce: bool = False,
                    bucket_numel: int | None = None, compile: str | None = None,
                    decoupled_lr: float | None = None, per_token: bool = False) -> dict:
    """One step, in place: state's buffers (and so state.params and state.opt_state, their views) hold the
    next step's values afterwards. With check_overflow (fp16), a step whose gradients hold inf/nan on any
    rank changes nothing and reports skipped=True, and loss_non_finite: whether the loss itself was inf/nan
    (no loss scale can cure that). overlap_grad_reduce starts each data-parallel bucket's
    reduction as soon as the backward pass has finished its gradients (same numbers; bucket_numel elements
    per bucket). compile: a torch.compile backend for each stage, one graph (gpt_pipeline.stage_segments,
    fused), or for each layer, the embedding and the head when the data-parallel overlap needs the layers'
    gradients one by one or whole layers are recomputed; None for eager. decoupled_lr: the word embedding's and output layer's
    learning rate (Megatron's --decoupled-lr; default lr). per_token: the loss is the sum of the global batch's
    token losses over its number of tokens (Megatron's --calculate-per-token-loss), not the mean of the
    microbatch means; the two agree when every microbatch counts as many tokens.
    The metrics' loss and grad_norm are device tensors: reading them is the caller's sync."""
    t0 = time.perf_counter()
    params = state.params
    tp = model_parallel(layout, mesh)
    # Compiled, each stage is one graph (fused), unless its layers' gradients must be handed over one by one
    # (data-parallel overlap) or whole layers are recomputed.
    fused = compile is not None and not (overlap_grad_reduce and layout.dp > 1) and \
        (layout.recompute is None or layout.recompute[0] == "selective") and layout.sharding != "optim_grads_params"
    fns = {s: gp.stage_segments(config, s, layout.num_stages, tp, layout.recompute, compile, per_token, fused,
                                layout.recompute_modules) for s in params}
    actions = rank_schedule(layout, len(microbatches), mesh.coord("pp"))
    microbatches, (moe_metrics, moe_counts) = with_aux_losses(microbatches, config, loss_scale, per_token, layout.cp,
                                                              mesh.group("cp")) \
        if config.num_experts else (microbatches, (None, None))
    microbatches, mtp_metrics = with_mtp_metrics(microbatches, config)
    # summed over dp x cp, divided by dp: each cp rank's gradient is its tokens' share, so the sum over cp of the
    # data-parallel mean
    sync = state.grad_sync(mesh.group("dp_cp"), bucket_numel=bucket_numel, overlap=overlap_grad_reduce,
                           replicated=tied_paths(config, layout, params) if state.zero else frozenset(),
                           divisor=layout.dp)
    loss, _ = execute.execute(actions, fns, params, microbatches, mesh.group("pp"), layout.num_stages,
                              loss_scale=loss_scale, grads_into=sync,  # accumulated straight into state.grad
                              microbatch_mean=not per_token, use=state.use)
    state.end_iteration()
    t1 = time.perf_counter()
    sync.finish()  # in the buffer (without overlap, every bucket starts now)
    _sync_tied(sync, config, layout, mesh, params)
    sync.settle()
    data_group = mesh.group("dp_cp")
    if data_group is not None and loss is not None:  # each cp rank's loss is its tokens' share: summed over cp
        loss = data_group.all_reduce(loss) / layout.dp
    grads = state.main_grads()  # this rank's owned slices, in fp32 (copies where gradients are reduced in fp16/bf16)
    if per_token:  # grad and loss hold data-parallel means of sums: times dp / the global batch's tokens
        tokens = sum(gpt.loss_tokens(mb) for mb in microbatches).to(grads[0].device)
        tokens_group = mesh.group("dp_cp")
        tokens = tokens_group.all_reduce(tokens) if tokens_group is not None else tokens
        factor = layout.dp / tokens.clamp_min(1.0)
        torch._foreach_mul_(grads, factor.to(grads[0].dtype))
        loss = None if loss is None else loss * factor
    if loss_scale != 1.0:
        torch._foreach_div_(grads, loss_scale)
    t2 = time.perf_counter()

    def timers(t3: float) -> dict:
        return {"forward-backward": (t1 - t0) * 1e3, "grads-reduce": (t2 - t1) * 1e3, "optimizer": (t3 - t2) * 1e3}

    # every element of the owned slices is some data-parallel rank's: the overflow check sees them all
    if check_overflow:
        overflow, loss_non_finite = _non_finite(grads, loss, mesh)
        if overflow:
            return {"loss": loss, "grad_norm": torch.tensor(float("nan")), "skipped": True,
                    "loss_non_finite": loss_non_finite, "timers_ms": timers(time.perf_counter())}
    norm = state.step(mesh, lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, decoupled_lr=decoupled_lr)
    if moe_counts is not None:
        update_expert_bias(state, moe_counts, config, layout, mesh)
    per_layer: dict = {}
    return {"loss": loss, "grad_norm": norm, "skipped": False, "timers_ms": timers(time.perf_counter()),
            "aux_losses": {**aux_loss_values(moe_metrics, config, layout, mesh, per_layer),
                           **mtp_loss_values(mtp_metrics, layout, mesh)},
            "aux_losses_per_layer": per_layer}
