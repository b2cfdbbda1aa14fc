"""The runner's flags checked together, before any process group exists: every problem as one line.

    problems = validate(parse_args(argv), world_size=4)

Validation is a pure function of the arguments and the world size (and of the files the flags name).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any, Callable


from fmeg.data.blending import parse_blend, parse_split
from fmeg.config.arguments import GROUPS, batch_geometry, build_parser, lr_steps
from fmeg.config.batch_schedule import check_rampup, parse_step_schedule
from fmeg.config import (
    context_flags,
    fsdp_flags,
    gpt_oss_flags,
    mla_flags,
    modelopt_flags,
    moe_flags,
    mtp_flags,
)
from fmeg.config.megatron_flags import later_work_problems


class Problems(list):
    """A list of one-line problems and need(ok, message), which adds message when ok is false."""

    @classmethod
    def start(cls) -> tuple["Problems", Callable[[Any, str], None]]:
        problems = cls()
        return problems, problems.need

    def need(self, ok: Any, message: str) -> None:
        if not ok:
            self.append(message)


def virtual_chunks(a: argparse.Namespace) -> int:
    """Virtual pipeline stages per pipeline rank the flags give (1 when they give a bad number)."""
    per_layer = a.num_layers_per_virtual_pipeline_stage
    if per_layer is None or per_layer <= 0:
        return 1
    return max(1, a.num_layers // a.pipeline_model_parallel_size // per_layer)


def microbatches_per_step(a: argparse.Namespace, world_size: int) -> int:
    """Microbatches each data-parallel rank runs a step (0 when the batch does not divide)."""
    dp, gbs = batch_geometry(a, world_size)
    return gbs // (a.micro_batch_size * dp) if gbs % (a.micro_batch_size * dp) == 0 else 0


# The sizes the checks across groups divide by.
SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
    "log_interval",
    "train_iters",
)


def validate(a: argparse.Namespace, world_size: int) -> list[str]:
    """Every problem with the arguments, one line each (empty when they are consistent). A feature
    fmeg does not have yet is the only problem reported: the layout checks would be about a run that
    cannot happen."""
    # alone: the other checks would repeat them
    problems = later_work_problems(a) + modelopt_flags.problems(a) or non_finite_problems(a)
    if problems:
        return problems

    # each group's own checks first; the checks across groups need their sizes positive
    problems = [line for cls in GROUPS for line in cls.from_namespace(a).problems()]
    if problems and any(getattr(a, size) <= 0 for size in SIZES):
        return problems
    for part in (
        _layout_problems,
        _pipeline_problems,
        _batch_problems,
        _feature_problems,
        _run_problems,
        _optimizer_problems,
        _data_problems,
    ):
        problems.extend(part(a, world_size))
    return problems


def _layout_problems(a: argparse.Namespace, world_size: int) -> list[str]:
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


def _pipeline_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The pipeline's layout string and virtual stages against the layers."""
    problems, need = Problems.start()
    pp = a.pipeline_model_parallel_size
    problems.extend(getattr(a, "layout_problems", []))
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


def _batch_problems(a: argparse.Namespace, world_size: int) -> list[str]:
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


def _feature_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """Each feature's flags, checked by its module."""
    problems = Problems()
    tp = a.tensor_model_parallel_size
    problems.extend(moe_problems(a, tp))
    problems.extend(context_flags.problems(a, world_size))
    problems.extend(fsdp_flags.problems(a))
    problems.extend(mla_flags.problems(a))
    problems.extend(mtp_flags.problems(a))
    problems.extend(gpt_oss_flags.problems(a))
    return problems


def _run_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The checkpoints, devices, logging, recomputation and precision flags."""
    problems, need = Problems.start()
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    dp, gbs = batch_geometry(a, world_size)
    vp_chunks, microbatches = virtual_chunks(a), microbatches_per_step(a, world_size)
    if vp_chunks > 1 and microbatches:
        need(
            microbatches >= pp,
            f"interleaved pipelining needs at least --pipeline-model-parallel-size ({pp}) "
            f"microbatches per step, got {microbatches}; raise --global-batch-size",
        )
    problems.extend(recompute_problems(a))
    problems.extend(unused_flag_problems(a))
    need(
        # Megatron's default: the final global batch
        a.eval_global_batch_size in (None, gbs),
        f"--eval-global-batch-size {a.eval_global_batch_size}: a validation batch other than the "
        f"final global batch ({gbs}) is not supported by fmeg yet; drop the flag",
    )
    problems.extend(optimizer_precision_problems(a))
    need(
        not a.sequence_parallel or a.seq_length % tp == 0,
        f"--seq-length {a.seq_length} must be divisible by --tensor-model-parallel-size {tp} with "
        "--sequence-parallel",
    )
    max_pos = a.max_position_embeddings or a.seq_length
    need(
        a.seq_length <= max_pos,
        f"--seq-length {a.seq_length} exceeds --max-position-embeddings {max_pos}",
    )
    return problems


def _optimizer_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The learning-rate warmup against the run's length, and the vocabulary against tp (the
    optimizer's and model's own flags: their groups' problems())."""
    problems, need = Problems.start()
    decay = a.lr_decay_iters or a.train_iters
    need(
        a.lr_warmup_iters < decay
        or a.lr_decay_style == "constant"
        or a.lr_warmup_fraction is not None
        or lr_steps(a)[2],
        f"--lr-warmup-iters {a.lr_warmup_iters} must be below --lr-decay-iters {decay}",
    )
    tp = a.tensor_model_parallel_size
    if a.padded_vocab_size is not None:
        need(
            a.padded_vocab_size % tp == 0,
            f"--padded-vocab-size {a.padded_vocab_size} must be divisible by "
            f"--tensor-model-parallel-size {tp}",
        )
    return problems


def _data_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The data, the tokenizer and the directories the run writes."""
    problems, need = Problems.start()
    need(
        not (a.mock_data and a.data_path), "--mock-data and --data-path are alternatives; give one"
    )
    need(
        a.tokenizer_type != "NullTokenizer" or (a.vocab_size or 0) > 1,
        "--tokenizer-type NullTokenizer needs a --vocab-size of at least 2 (its ids, the last the "
        "end of document)",
    )
    need(
        a.tokenizer_type != "TikTokenizer" or (a.tokenizer_model and a.tiktoken_pattern),
        "--tokenizer-type TikTokenizer needs --tokenizer-model PATH.json and --tiktoken-pattern "
        "v1|v2",
    )
    need(
        not a.sft or a.tokenizer_type == "SFTTokenizer",
        "--sft needs --tokenizer-type SFTTokenizer --tokenizer-model HF_DIR (a tokenizer with a "
        "chat template)",
    )
    need(
        not a.sft or a.data_path,
        '--sft needs --data-path FILE.jsonl (lines of {"messages": [...]})',
    )
    need(
        not a.sft_sequence_packing or a.sft,
        "--sft-sequence-packing packs conversations: it needs --sft",
    )
    need(
        a.num_workers >= 0,
        "--num-workers must be >= 0 (0 builds samples on the training thread), got "
        f"{a.num_workers}",
    )
    if a.fim_data:
        from fmeg.config.run_config import fim_settings

        problems.extend(fim_settings(a).problems())
        need(
            not a.mock_data,
            "--fim-data rearranges text and --mock-data has none (as in Megatron); give "
            "--data-path",
        )
        need(not a.sft, "--fim-data and --sft are different datasets; give one")
    if a.data_path:
        try:
            prefixes, _ = parse_blend(a.data_path)
        except ValueError as e:
            problems.append(str(e))
            prefixes = []
        for prefix in prefixes:
            if a.sft:
                need(os.path.isfile(prefix), f"--data-path {prefix}: no such JSONL file")
            else:
                need(
                    os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin"),
                    f"--data-path {prefix}: no {prefix}.bin / {prefix}.idx",
                )
    try:
        parse_split(a.split)
    except ValueError as e:
        problems.append(str(e))
    for flag in ("save", "log_dir", "tensorboard_dir", "data_cache_path", "wandb_save_dir"):
        # used with a project only
        path = getattr(a, flag) if flag != "wandb_save_dir" or a.wandb_project else None
        problem = unwritable_directory(path) if path else None
        need(problem is None, f"--{flag.replace('_', '-')} {path}: {problem}")
    return problems


def non_finite_problems(a: argparse.Namespace) -> list[str]:
    """One line for each float flag given as inf or nan (argparse and YAML both take them)."""
    floats = {
        action.dest: action.option_strings[0]
        for action in build_parser()._actions
        if action.type is float
    }

    def bad(value) -> list[float]:
        values = value if isinstance(value, list) else [value]
        return [v for v in values if isinstance(v, float) and not math.isfinite(v)]

    return [
        f"{flag} must be a finite number, got {bad(getattr(a, dest, None))[0]}"
        for dest, flag in floats.items()
        if bad(getattr(a, dest, None))
    ]


def unwritable_directory(path: str) -> str | None:
    """Why a directory cannot be written or created at path (None when it can): a file is in the
    way, or the nearest existing directory is not writable (a read-only filesystem included)."""
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        return "is a file, not a directory; name a directory"
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so no directory can be made under it; name a directory"
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_make_directory_in(existing):
        return (
            f"{existing} is not writable "
            f"({'read-only' if existing == target else 'cannot create it'}); name a directory you "
            "can write"
        )
    return None


def _can_make_directory_in(directory: Path) -> bool:
    """Whether a directory can really be made there (root passes os.access on read-only places like
    /proc): one is made and removed at once."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fmeg-probe-", dir=directory))
        return True
    except OSError:
        return False


def optimizer_precision_problems(a: argparse.Namespace) -> list[str]:
    """Megatron's precision-aware optimizer flags: the dtypes act with
    --use-precision-aware-optimizer only, and fmeg stores the moments in fp32 or bf16 (fp16 and fp8
    moments need Megatron's per-tensor scaling) with fp32 main weights and gradients."""
    given = {
        flag: getattr(a, flag)
        for flag in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if getattr(a, flag) != "fp32"
    }
    if given and not a.use_precision_aware_optimizer:
        flag, value = next(iter(given.items()))
        return [
            f"--{flag.replace('_', '-')} {value} acts with --use-precision-aware-optimizer (as in "
            "Megatron): add it, or drop the flag"
        ]
    out = []
    for flag in ("main_grads_dtype", "main_params_dtype"):
        if flag in given:
            out.append(
                f"--{flag.replace('_', '-')} {given[flag]}: fmeg keeps fp32 main weights and "
                "gradients (not yet narrower ones); use fp32"
                + (
                    " (--grad-reduce-in-bf16 reduces them in bf16)"
                    if flag == "main_grads_dtype"
                    else ""
                )
            )
    for flag in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if given.get(flag) in ("fp16", "fp8"):
            out.append(
                f"--{flag.replace('_', '-')} {given[flag]}: moments in fp16 or fp8 need Megatron's "
                "scaling, which fmeg does not have yet; use bf16 or fp32"
            )
    return out


# flags that only mean something beside another: {dest given: (what it needs, the flag that gives
# it)}
_NEEDS = {
    **{
        dest: ("multi_latent_attention", "--multi-latent-attention")
        for dest in (
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
        )
    },
    **{
        dest: ("fim_data", "--fim-data")
        for dest in (
            "fim_rate",
            "fim_spm_rate",
            "fim_split_sample",
            "fim_fragment_rate",
            "fim_no_prefix",
        )
    },
    "window_attn_skip_freq": ("window_size", "--window-size"),
}


def unused_flag_problems(a: argparse.Namespace) -> list[str]:
    """Flags given that would change nothing, one line each (a silent no-op hides a mistaken
    command)."""
    given = set(getattr(a, "given", ()))
    out = [
        f"--{dest.replace('_', '-')} applies to {flag}, which is not given: add it or drop this "
        "flag"
        for dest, (need, flag) in _NEEDS.items()
        if dest in given and not getattr(a, need)
    ]
    experts = [m for m in a.recompute_modules or () if m in ("moe", "moe_act")]
    if experts and not a.num_experts and "recompute_modules" in given:
        out.append(
            f"--recompute-modules {experts[0]} recomputes the experts, and the model has none "
            "(--num-experts): drop it"
        )
    if (
        "shared_experts" in (a.recompute_modules or ())
        and not a.moe_shared_expert_intermediate_size
    ):
        out.append(
            "--recompute-modules shared_experts recomputes the shared experts, and the model has "
            "none (--moe-shared-expert-intermediate-size): drop it"
        )
    return out


def recompute_problems(a: argparse.Namespace) -> list[str]:
    """Megatron's rules for the recompute flags, one line each."""
    per_rank = a.num_layers // a.pipeline_model_parallel_size
    if a.recompute_modules is not None and a.recompute_granularity != "selective":
        return [
            "--recompute-modules applies to --recompute-granularity selective (or "
            "--recompute-activations)"
        ]
    if "mla_up_proj" in (a.recompute_modules or ()) and not a.multi_latent_attention:
        return [
            "--recompute-modules mla_up_proj recomputes multi-latent attention's up-projections: "
            "add --multi-latent-attention or drop it"
        ]
    if a.recompute_granularity is None:
        given = [
            f for f in ("recompute_method", "recompute_num_layers") if getattr(a, f) is not None
        ]
        return [f"--{f.replace('_', '-')} needs --recompute-granularity full" for f in given]
    if a.recompute_granularity == "selective":
        given = [
            f for f in ("recompute_method", "recompute_num_layers") if getattr(a, f) is not None
        ]
        return [
            f"--{f.replace('_', '-')} applies to --recompute-granularity full, not selective"
            for f in given
        ]
    if a.recompute_method is None or a.recompute_num_layers is None:
        return [
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers"
        ]
    low = 1 if a.recompute_method == "uniform" else 0
    if not low <= a.recompute_num_layers <= per_rank:
        return [
            f"--recompute-num-layers {a.recompute_num_layers} must be between {low} and the "
            f"{per_rank} layers of each pipeline rank with --recompute-method {a.recompute_method}"
        ]
    return []


def moe_problems(a: argparse.Namespace, tp: int) -> list[str]:
    """Megatron's mixture-of-experts argument rules, each naming its flag."""
    problems = moe_flags.problems(a)
    e, k = a.num_experts, a.moe_router_topk
    if e is None:
        return problems

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(e > 0, f"--num-experts must be positive, got {e}")
    need(0 < k <= max(e, 1), f"--moe-router-topk {k} must be in [1, --num-experts {e}]")
    freq = a.moe_layer_freq
    if isinstance(freq, int):
        need(freq > 0, f"--moe-layer-freq must be positive, got {freq}")
    else:
        need(
            len(freq) == a.num_layers,
            f"--moe-layer-freq: the pattern has {len(freq)} entries for --num-layers "
            f"{a.num_layers}; give one per layer",
        )
    ffn = a.moe_ffn_hidden_size or a.ffn_hidden_size
    need(
        a.moe_ffn_hidden_size is None or a.moe_ffn_hidden_size > 0,
        "--moe-ffn-hidden-size must be positive",
    )
    need(
        ffn is None or ffn % tp == 0,
        f"--moe-ffn-hidden-size {ffn} must be divisible by --tensor-model-parallel-size {tp}",
    )
    shared = a.moe_shared_expert_intermediate_size
    need(
        shared is None or (shared > 0 and shared % tp == 0),
        f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    need(
        not a.moe_shared_expert_gate or shared,
        "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size",
    )
    groups, group_topk = a.moe_router_num_groups, a.moe_router_group_topk
    if groups or group_topk:
        need(
            bool(groups) and bool(group_topk),
            "--moe-router-num-groups and --moe-router-group-topk go together",
        )
        if groups and group_topk and e > 0:
            need(e % groups == 0, f"--moe-router-num-groups {groups} must divide --num-experts {e}")
            need(
                group_topk <= groups,
                f"--moe-router-group-topk {group_topk} exceeds --moe-router-num-groups {groups}",
            )
            need(
                e % groups or (k % group_topk == 0 and k // group_topk <= max(e // groups, 1)),
                f"--moe-router-topk {k} must be a multiple of --moe-router-group-topk "
                f"{group_topk}, taking at most {e // groups} experts (one group's) from each group",
            )
    need(
        a.moe_expert_capacity_factor is None or a.moe_expert_capacity_factor > 0,
        "--moe-expert-capacity-factor must be positive",
    )
    need(
        not a.moe_pad_expert_input_to_capacity or a.moe_expert_capacity_factor is not None,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )
    need(min(a.moe_aux_loss_coeff) >= 0, "--moe-aux-loss-coeff must be >= 0")
    return problems


def wandb_missing(project: str | None) -> str | None:
    """The one line for --wandb-project without the package (None when it is not asked for or
    installed)."""
    if not project:
        return None
    try:
        import wandb  # noqa: F401
    except ImportError:
        return (
            f"--wandb-project {project} needs the wandb package: pip install wandb (or "
            '"fmeg[wandb]")'
        )
    return None
