"""One training iteration for any tensor/sequence/pipeline/data-parallel layout.

Parameters live as {stage: this rank's tensor-parallel shard of that stage}; with pp = 1 there is
one stage and the same code runs. An iteration runs this rank's pipeline schedule over its
microbatches, sums the tied-embedding gradients, averages gradients over data parallelism, computes
the global gradient norm (each parameter counted once), clips, and applies AdamW to the local
shards, in place in the buffers of a FlatState. Every rank's shards then hold exactly the slices of
what a single rank would hold.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from fmeg import optim, tree
from fmeg.optim import loss_scale
from fmeg.models import gpt, moe
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.exact import fixed_point_sum
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.pipeline import execute, schedules
from fmeg.parallel.pipeline.segments import subtree
from fmeg.parallel.sharding import partition_of, shard
from fmeg.config.optimizer_flags import OptimizerConfig
from fmeg.state.flat import FlatState
from fmeg.training.fp8_state import record_fp8_weights
from fmeg.training.step_settings import StepSettings
from fmeg.fp8 import delayed
from fmeg.training import optimizers, step_hooks
from fmeg.training.stage_functions import model_parallel, stage_functions


def shard_params(full: Any, config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> dict[int, Any]:
    """{stage: tensor- (and expert-) parallel shard} for this rank's stages, cut from the full
    (single-rank) parameters."""
    stages = gp.split(full, config, layout.stages)
    coords = {"tp": (mesh.coord("tp"), layout.tp), "ep": (mesh.coord("ep"), layout.ep)}
    if layout.experts_apart:
        coords["etp"] = (mesh.coord("expert_tp"), layout.expert_tp)
    return {
        s: shard(stages[s], gpt.TP_RULES + moe.EP_RULES, coords)
        for s in layout.stages_on(mesh.coord("pp"))
    }


def rank_schedule(layout: Layout, microbatches: int, pp_rank: int):
    """This rank's actions, communication included (the same every iteration of a batch size)."""
    return list(_full_schedule(layout.schedule, layout.pp, microbatches, layout.chunks)[pp_rank])


@functools.lru_cache(maxsize=8)
def _full_schedule(name: str, pp: int, microbatches: int, chunks: int) -> tuple:
    # generated once: ZB-V's list scheduler and its simulation take a fraction of a second at
    # hundreds of microbatches
    full = schedules.with_communication(schedules.by_name(name, pp, microbatches, chunks))
    return tuple(tuple(actions) for actions in full)


def evaluate(
    params: dict[int, Any],
    microbatches: list[dict],
    *,
    config: gpt.GPTConfig,
    layout: Layout,
    mesh: Mesh,
    compile: str | None = None,
    use: Any = None,
    fp8: Any = None,
) -> torch.Tensor | None:
    """[sum of the token losses, number of tokens] over the microbatches and data parallelism,
    forward only; None off the last stage's ranks. Validation divides the sums over all its batches,
    as Megatron reports its validation loss: a mean over tokens, whatever the loss masks. use: the
    state's use (sharded weights); fp8: the run's Fp8Plan."""
    tp = model_parallel(layout, mesh, fp8)
    fns = {
        s: gp.stage_segments(
            config, s, layout.stages, tp, compile=compile, per_token=True, fused=compile is not None
        )
        for s in params
    }
    forwards = schedules.forwards(layout.placement, len(microbatches))
    actions = schedules.with_communication(forwards)[mesh.coord("pp")]
    loss, _ = execute.execute(
        actions,
        fns,
        params,
        microbatches,
        mesh.group("pp"),
        layout.num_stages,
        forward_only=True,
        microbatch_mean=False,
        placement=layout.placement,
        **({"use": use} if use else {}),
    )
    pair = None
    if loss is not None:
        tokens = sum(gpt.loss_tokens(mb) for mb in microbatches).to(loss.device)
        pair = torch.stack([loss.double(), tokens.double()])
        # every rank's tokens: data and context parallel
        group = mesh.group("dp_cp")
        pair = group.all_reduce(pair) if group is not None else pair
    return to_last_rank(pair, layout, mesh)


# the tag of the loss's one message from the last stage to the last pipeline rank
LOSS_TAG = 2


def to_last_rank(value: torch.Tensor | None, layout: Layout, mesh: Mesh) -> torch.Tensor | None:
    """The loss where the runner reads and logs it, on the last pipeline rank (as Megatron logs
    from the last rank): under a V the last stage is on pipeline rank 0, which sends it over.
    None on the other ranks."""
    last, holder = layout.pp - 1, layout.loss_rank
    if holder == last:
        return value
    group, rank = mesh.group("pp"), mesh.coord("pp")
    if rank == holder:
        group.send(value, last, LOSS_TAG)
        group.finish()
        return None
    return group.recv(holder, LOSS_TAG) if rank == last else None


def counted_once(config: gpt.GPTConfig, layout: Layout, mesh: Mesh):
    """keep(path, leaf) for the norm: False for the tied output copy and, off tensor-parallel rank
    0, for leaves replicated over tp, so that every parameter is counted exactly once."""
    from fmeg.state.experts import is_expert

    tp_rank, expert_tp_rank, last = (
        mesh.coord("tp"),
        mesh.coord("expert_tp"),
        str(layout.num_stages - 1),
    )
    copy = gp.embedding_copy(config)

    def keep(path: str, leaf: torch.Tensor) -> bool:
        stage, _, rest = path.partition(".")
        if stage == last and rest == copy:
            return False
        rank = expert_tp_rank if layout.experts_apart and is_expert(rest) else tp_rank
        return not (partition_of(rest, gpt.TP_RULES) is None and rank != 0)

    return keep


def global_norm(
    values: dict[int, Any], config: gpt.GPTConfig, layout: Layout, mesh: Mesh
) -> torch.Tensor:
    """The global L2 norm of this rank's {stage: tree} of gradients or parameters (the same on every
    data-parallel rank): tensor-parallel shards summed over tp, replicated leaves and the tied
    output copy counted once, stages summed over pp (one all-reduce over the tp-pp group); under
    expert parallelism the experts' squares are summed over tp x ep x pp instead."""
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


def init_state(
    params: dict[int, Any],
    config: gpt.GPTConfig,
    layout: Layout,
    mesh: Mesh,
    *,
    compute_dtype: torch.dtype = torch.float32,
    optimizer: OptimizerConfig = OptimizerConfig(),
    grad_dtype: torch.dtype = torch.float32,
    device: Any = None,
    reshard_after_forward: str = "true",
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    scaler: loss_scale.LossScale | None = None,
    fp32_master: bool = False,
) -> FlatState:
    """This rank's training state from its fp32 params ({stage: tree}, or their shapes as meta
    tensors with the device to hold the state on: state.assign() or a checkpoint then fills it): the
    model's weights in the compute dtype, fp32 master weights when computing in bf16 / fp16, and the
    optimizer's moments (fmeg.training.optimizers), for all local parameters or, with the
    distributed optimizer, this data-parallel slice (fmeg.state.flat). Gradients are accumulated and
    reduced in grad_dtype (bf16: Megatron's --grad-reduce-in-bf16), Adam's moments stored in
    moment_dtypes (Megatron's precision-aware optimizer: bf16, stepped in fp32), the loss scaled by
    scaler's scale (fp16: the optimizer wrapped by optim.with_loss_scale). Under expert parallelism
    the experts' leaves have a state of their own (fmeg.state.experts). fp32_master: an fp32
    master apart from fp32 compute weights (--fp8-param-gather's weights are FP8 numbers)."""
    tx = optimizers.build(optimizer, config, embedding_or_output(layout), moment_dtypes)
    options = dict(
        compute_dtype=compute_dtype,
        grad_dtype=grad_dtype,
        device=device,
        reshard_after_forward=reshard_after_forward,
        optimizer=optim.with_loss_scale(tx, scaler) if scaler else tx,
        gather=optimizers.TensorParallelLeaves(layout, mesh, optimizer.blockwise),
        fp32_master=fp32_master,
    )
    if layout.experts_apart:
        from fmeg.state.experts import ExpertSplitState

        return ExpertSplitState(
            params,
            counted_once(config, layout, mesh),
            mesh,
            sharding=layout.sharding,
            dp=layout.dp,
            **options,
        )
    return FlatState(
        params,
        counted_once(config, layout, mesh),
        sharding=layout.sharding,
        dp=mesh.size("dp_cp_shard"),
        dp_rank=mesh.coord("dp_cp_shard"),
        dp_group=mesh.group("dp_cp_shard"),
        replica_group=mesh.group("dp_cp_outer"),
        **options,
    )


def local_shapes(config: gpt.GPTConfig, layout: Layout, mesh: Mesh) -> dict[int, Any]:
    """This rank's {stage: tree} as shard_params cuts the model, as meta tensors: shapes only,
    nothing stored."""
    with torch.device("meta"):
        return shard_params(gpt.init(config, 0, device="meta"), config, layout, mesh)


def initialized_state(
    config: gpt.GPTConfig, layout: Layout, mesh: Mesh, *, seed: int, **options: Any
) -> FlatState:
    """init_state of this rank's shard of gpt.init(config, seed), bitwise, built a unit (a layer,
    the embedding, the head) at a time, as Megatron's --init-model-with-meta-device builds it: each
    unit of this rank's stages is drawn whole in fp32, cut to this rank's shard and copied into the
    state (with sharded weights, the slice held here only), so no rank ever holds more of the model
    at once than its state and one unit. options: init_state's (device: where the state lives)."""
    state = init_state(local_shapes(config, layout, mesh), config, layout, mesh, **options)
    for stage in layout.stages_on(mesh.coord("pp")):
        for unit in gp.stage_units(config, stage, layout.stages):
            state.assign(shard_params(gpt.init(config, seed, only=unit), config, layout, mesh))
    return state


def embedding_or_output(layout: Layout):
    """decoupled(path, leaf): the word embedding and the output layer (the copies of the embedding
    included), the leaves Megatron's --decoupled-lr applies to."""
    last = str(layout.num_stages - 1)

    def decoupled(path: str, leaf: torch.Tensor) -> bool:
        stage, _, rest = path.partition(".")
        return rest == "embedding.word.weight" or (
            stage == last and rest in ("output.weight", "mtp_embedding.weight")
        )

    return decoupled


def _non_finite(
    grads: list[torch.Tensor], loss: torch.Tensor | None, mesh: Mesh
) -> tuple[bool, bool]:
    """(any rank's gradient holds inf/nan, the loss is inf/nan where it is held): one all-reduce of
    two flags, one host sync."""
    device = grads[0].device
    bad_loss = (
        (~torch.isfinite(loss)).any()
        if loss is not None
        else torch.zeros((), dtype=torch.bool, device=device)
    )
    bad_grad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
    flags = torch.stack([bad_grad, bad_loss.to(device)]).float()
    for name in ("dp_cp", "mp"):
        group = mesh.group(name)
        flags = group.all_reduce(flags, "max") if group is not None else flags
    overflow, loss_bad = flags.tolist()
    return overflow > 0, loss_bad > 0


def tied_paths(config: gpt.GPTConfig, layout: Layout, stages: Any) -> frozenset[str]:
    """The flat paths ("stage.path") of this rank's copies of the word embedding (their gradients
    are summed over the first and last stage after the data-parallel mean):
    gpt_pipeline.embedding_copy."""
    copy = gp.embedding_copy(config)
    if copy is None:
        return frozenset()
    last = layout.num_stages - 1
    return frozenset(
        p for s, p in ((0, "0.embedding.word.weight"), (last, f"{last}.{copy}")) if s in stages
    )


def _sync_tied(sync: Any, config: gpt.GPTConfig, layout: Layout, mesh: Mesh, stages: Any) -> None:
    """Sum the tied copies' (data-parallel mean) gradients in place in the sync's whole views of
    them."""
    paths = tied_paths(config, layout, stages)
    if not paths:
        return
    held: dict[int, Any] = {}
    # {stage: {"embedding": {"word": {"weight": g}}} or {"output" / "mtp_embedding": {"weight": g}}}
    for path in paths:
        stage, _, rest = path.partition(".")
        node = held.setdefault(int(stage), {})
        *parents, name = rest.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = sync.leaf(path)
    synced = gp.sync_tied_embedding_grads(held, config, layout.stages, mesh.group("embedding"))
    for path in paths:
        stage, _, rest = path.partition(".")
        value = subtree(synced[int(stage)], rest)
        if value is not sync.leaf(path):
            sync.leaf(path).copy_(value)


def train_iteration(
    state: FlatState,
    microbatches: list[dict],
    *,
    config: gpt.GPTConfig,
    layout: Layout,
    mesh: Mesh,
    settings: StepSettings | None = None,
    **fields: Any,
) -> dict:
    """One step, in place: state's buffers (and so state.params and state.opt_state, their views)
    hold the next step's values afterwards; settings: this step's hyperparameters and policies
    (fmeg.training.step_settings), or its fields as keywords (lr=..., weight_decay=...). A step
    skipped for an overflow reports skipped=True and loss_non_finite: whether the loss itself was
    inf/nan (no loss scale can cure that). The metrics' loss and grad_norm are device tensors:
    reading them is the caller's sync."""
    if settings is not None and fields:
        raise TypeError("train_iteration: give settings or its fields as keywords, not both")
    s = settings or StepSettings(**fields)
    scaler = state.scaler
    scale = scaler.scale if scaler is not None else 1.0
    per_token, compile, exact = s.per_token, s.compile, s.deterministic
    overlap_grad_reduce = s.overlap_grad_reduce
    t0 = time.perf_counter()
    hooks = step_hooks.step_hooks(config, layout, mesh, loss_scale=scale, per_token=per_token)
    microbatches = step_hooks.prepare(hooks, microbatches)
    fns = stage_functions(
        state.params, config, layout, mesh, compile, overlap_grad_reduce, per_token, s.fp8, exact
    )
    reduce = dict(overlap_grad_reduce=overlap_grad_reduce, bucket_numel=s.bucket_numel, exact=exact)
    loss, sync = forward_backward(
        state, microbatches, fns, config, layout, mesh, scale, per_token=per_token, **reduce
    )
    _finish_fp8(s.fp8, mesh)
    t1 = time.perf_counter()
    _finish_reduction(sync, config, layout, mesh, state.params)
    loss, grads = mean_gradients(state, microbatches, loss, layout, mesh, scale, per_token, exact)
    t2 = time.perf_counter()

    def timers(t3: float) -> dict:
        names = ("forward-backward", "grads-reduce", "optimizer")
        return {name: (b - a) * 1e3 for name, a, b in zip(names, (t0, t1, t2), (t1, t2, t3))}

    # every element of the owned slices is some data-parallel rank's: the overflow check sees them
    # all
    overflow, loss_non_finite = (
        _non_finite(grads, loss, mesh) if s.check_overflow or scaler is not None else (False, False)
    )
    # the scaler's update, with_loss_scale's: after every step, skipped or not
    if scaler is not None:
        state.scaler = loss_scale.update(scaler, overflow)
    if overflow:
        nan = torch.tensor(float("nan"))
        return {
            "loss": loss,
            "grad_norm": nan,
            "skipped": True,
            "loss_non_finite": loss_non_finite,
            "loss_scale": scale,
            "timers_ms": timers(time.perf_counter()),
        }
    hyper = dict(lr=s.lr, weight_decay=s.weight_decay, clip_grad=s.clip_grad)
    norm = state.step(mesh, **hyper, decoupled_lr=s.decoupled_lr, exact=exact)
    for hook in hooks:
        hook.after_step(state)
    per_layer: dict = {}
    return {
        "loss": loss,
        "grad_norm": norm,
        "skipped": False,
        "loss_scale": scale,
        "timers_ms": timers(time.perf_counter()),
        "aux_losses": step_hooks.metrics(hooks, per_layer),
        "aux_losses_per_layer": per_layer,
    }


def _finish_reduction(sync: Any, config: gpt.GPTConfig, layout: Layout, mesh: Mesh, params: dict):
    """The data-parallel reduction finished in the buffer (without overlap, every bucket starts
    now), the tied embedding's copies summed."""
    sync.finish()
    _sync_tied(sync, config, layout, mesh, params)
    sync.settle()


def _finish_fp8(fp8: Any, mesh: Mesh) -> None:
    """Delayed scaling's amaxes of this iteration reduced over every rank and its scales renewed,
    skipped step or not (as Transformer Engine's)."""
    if fp8 is not None and fp8.state is not None:
        delayed.finish_step(fp8.state, fp8.recipe, (mesh.group("tp_dp_cp"), mesh.group("pp")))


def forward_backward(
    state: Any,
    microbatches: list[dict],
    fns: dict,
    config: gpt.GPTConfig,
    layout: Layout,
    mesh: Mesh,
    loss_scale: float,
    *,
    overlap_grad_reduce: bool,
    bucket_numel: int | None,
    per_token: bool,
    exact: bool = False,
) -> tuple[torch.Tensor | None, Any]:
    """This rank's pipeline schedule over its microbatches. overlap_grad_reduce starts each
    data-parallel bucket's reduction as soon as the backward has finished its gradients (same
    numbers; bucket_numel elements per bucket). The gradients are accumulated straight into
    state.grad and reduced over data parallelism (summed over dp x cp, divided by dp: each cp rank's
    gradient is its tokens' share, so the sum over cp of the data-parallel mean); the tied
    embedding's copies summed. Returns (the loss where this rank holds the last stage, else None;
    the gradient reduction, to be finished). exact (--deterministic-mode): the gradients summed
    exactly over microbatches and data parallelism, of the loss over the global batch's microbatch
    count, and the loss returned per microbatch (mean_gradients sums it exactly)."""
    params = state.params
    actions = rank_schedule(layout, len(microbatches), mesh.coord("pp"))
    sync = state.grad_sync(
        # hybrid sharding: summed within the instance here, over its replicas at finish
        mesh.group("dp_cp_shard"),
        bucket_numel=bucket_numel,
        overlap=overlap_grad_reduce,
        replicated=tied_paths(config, layout, params) if state.zero else frozenset(),
        divisor=1 if exact else layout.dp,
        exact=exact,
    )
    # --fp8-param-gather: this step's weight amaxes and scales, from the owned chunks
    record_fp8_weights(state)
    loss, _ = execute.execute(
        actions,
        fns,
        params,
        microbatches,
        mesh.group("pp"),
        layout.num_stages,
        loss_scale=loss_scale,
        grads_into=sync,
        microbatch_mean=not per_token,
        use=state.use,
        placement=layout.placement,
        mean_over=len(microbatches) * layout.dp if exact else None,
        loss_per_microbatch=exact,
    )
    state.end_iteration()
    return loss, sync


def mean_gradients(
    state: Any,
    microbatches: list[dict],
    loss: torch.Tensor | None,
    layout: Layout,
    mesh: Mesh,
    loss_scale: float,
    per_token: bool,
    exact: bool = False,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(the data-parallel loss, this rank's owned gradient slices in fp32) as the optimizer takes
    them: unscaled, and with per-token losses divided by the global batch's tokens; the loss on the
    last pipeline rank (to_last_rank). exact: the gradients are sums, not means, over dp
    (forward_backward's), and the loss comes per microbatch and is summed by fixed_point_sum."""
    data_group = mesh.group("dp_cp")
    # each cp rank's loss is its tokens' share: summed over cp
    if exact and loss is not None:
        loss = fixed_point_sum(loss, 0, data_group)
    elif data_group is not None and loss is not None:
        loss = data_group.all_reduce(loss) / layout.dp
    # this rank's owned slices, in fp32 (copies where gradients are reduced in fp16/bf16)
    grads = state.main_grads()
    # grad and loss hold data-parallel means of sums: times dp / the global batch's tokens
    if per_token:
        tokens = sum(gpt.loss_tokens(mb) for mb in microbatches).to(grads[0].device)
        tokens = data_group.all_reduce(tokens) if data_group is not None else tokens
        factor = (1 if exact else layout.dp) / tokens.clamp_min(1.0)
        torch._foreach_mul_(grads, factor.to(grads[0].dtype))
        loss = None if loss is None else loss * factor
    if loss_scale != 1.0:
        torch._foreach_div_(grads, loss_scale)
    return to_last_rank(loss, layout, mesh), grads
