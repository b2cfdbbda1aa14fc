"""The flags checked against the world: tensor, pipeline, context and expert parallel sizes that
divide it and the model, the pipeline's stages and schedule, and the batch sizes and schedules."""

from __future__ import annotations

import argparse


from fmeg.config.arguments import batch_geometry, lr_steps
from fmeg.config.batch_schedule import check_rampup, parse_step_schedule


from fmeg.config.problems import Problems


def virtual_chunks(a: argparse.Namespace) -> int:
    """Virtual pipeline stages per pipeline rank the flags give (1 when they give a bad number)."""
    if getattr(a, "pipeline_stage_layers", None):
        return max(1, len(a.pipeline_stage_layers) // a.pipeline_model_parallel_size)
    per_layer = a.num_layers_per_virtual_pipeline_stage
    if per_layer is None or per_layer <= 0:
        return 1
    return max(1, a.num_layers // a.pipeline_model_parallel_size // per_layer)


def microbatches_per_step(a: argparse.Namespace, world_size: int) -> int:
    """Microbatches each data-parallel rank runs a step (0 when the batch does not divide)."""
    dp, gbs = batch_geometry(a, world_size)
    return gbs // (a.micro_batch_size * dp) if gbs % (a.micro_batch_size * dp) == 0 else 0


def layout_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The sizes of the layout and the model checked against each other."""
    problems, need = Problems.start()
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    need(
        world_size % (tp * pp) == 0,
        f"world size {world_size} must be divisible by --tensor-model-parallel-size * "
        f"--pipeline-model-parallel-size = {tp} * {pp}",
    )
    dp, gbs = batch_geometry(a, world_size)
    ep, etp = a.expert_model_parallel_size, a.expert_tensor_parallel_size or tp
    cp = max(a.context_parallel_size, 1)
    need(
        a.num_experts is None
        or ep < 1
        or etp not in (1, tp)
        or (tp * dp * cp) % (ep * etp) == 0
        or world_size % (tp * pp) != 0,
        f"--expert-model-parallel-size {ep} x expert tensor parallelism {etp} must divide tp x dp "
        f"x cp = {tp} x {dp} x {cp} (the experts' ranks are the tensor-, data- and "
        "context-parallel ones)",
    )
    need(
        a.kv_channels is not None or a.hidden_size % a.num_attention_heads == 0,
        f"--hidden-size {a.hidden_size} must be divisible by --num-attention-heads "
        f"{a.num_attention_heads} (or give --kv-channels)",
    )
    need(
        a.kv_channels is None or a.kv_channels > 0,
        f"--kv-channels must be positive, got {a.kv_channels}",
    )
    need(
        not (a.swiglu and a.squared_relu),
        "--swiglu and --squared-relu are alternatives; choose one",
    )
    need(
        not a.use_rope_scaling or a.position_embedding_type == "rope",
        "--use-rope-scaling needs --position-embedding-type rope",
    )
    need(
        a.rope_scaling_factor > 0,
        f"--rope-scaling-factor must be positive, got {a.rope_scaling_factor}",
    )
    need(
        0 < a.rope_scaling_low_freq_factor < a.rope_scaling_high_freq_factor,
        "--rope-scaling-low-freq-factor must be positive and below --rope-scaling-high-freq-factor",
    )
    need(
        a.rope_scaling_original_max_position_embeddings > 0,
        "--rope-scaling-original-max-position-embeddings must be positive",
    )
    need(
        0.0 < a.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {a.rotary_percent}"
    )
    need(
        a.num_attention_heads % tp == 0,
        f"--num-attention-heads {a.num_attention_heads} must be divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    groups = a.num_query_groups
    # else one group per head, checked just above (0 and below: refused further down)
    if groups:
        need(
            a.num_attention_heads % groups == 0,
            f"--num-query-groups {groups} must divide --num-attention-heads "
            f"{a.num_attention_heads}",
        )
        need(
            groups % tp == 0,
            f"--num-query-groups {groups} must be divisible by --tensor-model-parallel-size {tp}",
        )
    if a.ffn_hidden_size is not None:
        need(
            a.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {a.ffn_hidden_size} must be divisible by "
            f"--tensor-model-parallel-size {tp}",
        )
    return problems


def hybrid_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """Hybrid sharding's instances against the data-parallel ranks and the experts."""
    problems, need = Problems.start()
    tp, pp, cp = (
        a.tensor_model_parallel_size,
        a.pipeline_model_parallel_size,
        a.context_parallel_size,
    )
    dp, _ = batch_geometry(a, world_size)
    ep, etp = a.expert_model_parallel_size, a.expert_tensor_parallel_size or tp
    instances = a.num_distributed_optimizer_instances
    need(
        instances < 1 or (dp * cp) % instances == 0 or world_size % (tp * pp) != 0,
        f"--num-distributed-optimizer-instances {instances} must divide data x context parallel "
        f"= {dp} x {cp}",
    )
    # the experts' data-parallel ranks: every rank but their tp and ep ones
    edp = dp * tp * cp // (ep * etp) if ep * etp else 0
    need(
        instances < 1
        or not (a.num_experts and (ep > 1 or etp != tp))
        or edp % instances == 0
        or world_size % (tp * pp) != 0,
        f"--num-distributed-optimizer-instances {instances} must divide the experts' data-parallel "
        f"size {edp} (tp x dp x cp / (ep x expert tp) = {tp} x {dp} x {cp} / ({ep} x {etp}))",
    )
    return problems


def pipeline_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The pipeline's layout string and virtual stages against the layers."""
    problems, need = Problems.start()
    pp = a.pipeline_model_parallel_size
    problems.extend(getattr(a, "layout_problems", []))
    if getattr(a, "pipeline_stage_layers", None):
        # uneven stages: pipeline_layout.apply checked that they hold every layer
        need(
            len(a.pipeline_stage_layers) == pp or pp > 1,
            "virtual pipeline stages need --pipeline-model-parallel-size > 1",
        )
        return problems
    vp_chunks = 1
    if a.num_layers_per_virtual_pipeline_stage is not None:
        need(
            pp > 1,
            "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1",
        )
        per_rank = a.num_layers // pp
        need(
            a.num_layers_per_virtual_pipeline_stage > 0
            and per_rank % a.num_layers_per_virtual_pipeline_stage == 0,
            f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage} "
            f"must divide the {per_rank} layers each pipeline rank holds",
        )
        if a.num_layers_per_virtual_pipeline_stage > 0:
            vp_chunks = max(1, per_rank // a.num_layers_per_virtual_pipeline_stage)
    need(
        a.num_layers % (pp * vp_chunks) == 0,
        f"--num-layers {a.num_layers} must be divisible by --pipeline-model-parallel-size * "
        f"virtual stages = {pp} * {vp_chunks}",
    )
    return problems


def batch_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The batch sizes, their ramp-up and the schedules that count samples."""
    problems, need = Problems.start()
    dp, gbs = batch_geometry(a, world_size)
    need(
        gbs % (a.micro_batch_size * dp) == 0
        # its own check names each batch
        or a.step_batch_size_schedule,
        f"--global-batch-size {gbs} must be divisible by --micro-batch-size * data-parallel size = "
        f"{a.micro_batch_size} * {dp}",
    )
    if a.rampup_batch_size:
        problems.extend(check_rampup(*a.rampup_batch_size, gbs, a.micro_batch_size * dp))
    if a.step_batch_size_schedule is not None:
        need(
            not a.rampup_batch_size,
            "--step-batch-size-schedule and --rampup-batch-size are alternatives; choose one",
        )
        try:
            steps = parse_step_schedule(a.step_batch_size_schedule, a.seq_length)
        except ValueError as e:
            problems.append(str(e))
            steps = ()
        odd = [batch for _, batch in steps if batch % (a.micro_batch_size * dp)]
        need(
            not odd,
            f"--step-batch-size-schedule: batch sizes {odd} must be multiples of "
            f"--micro-batch-size * data-parallel size = {a.micro_batch_size} * {dp}",
        )
    need(
        a.lr_warmup_samples is None or a.lr_warmup_fraction is None,
        "--lr-warmup-samples and --lr-warmup-fraction are alternatives; choose one",
    )
    need(
        a.lr_warmup_samples is None
        or a.lr_decay_samples is not None
        or a.train_samples is not None,
        "--lr-warmup-samples needs --lr-decay-samples or --train-samples (the schedule counts "
        "samples)",
    )
    need(
        a.lr_decay_samples is None
        or a.lr_warmup_samples is not None
        or a.lr_warmup_fraction is not None
        or a.train_samples is not None,
        "--lr-decay-samples needs --lr-warmup-samples or --lr-warmup-fraction (the schedule "
        "counts samples)",
    )
    warmup, decay_steps, in_samples = lr_steps(a)
    if in_samples:
        need(
            0 <= warmup < decay_steps or a.lr_decay_style == "constant",
            f"the LR warmup of {warmup} samples must be below the decay's {decay_steps} samples "
            "(--lr-warmup-samples, --lr-decay-samples, --train-samples)",
        )
    return problems
