"""The runner's flags checked together, before any process group exists: every problem as one line.

    problems = validate(parse_args(argv), world_size=4)

Validation is a pure function of the arguments and the world size (and of the files the flags name).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


from fmeg.data.blending import parse_blend, parse_split
from fmeg.config.arguments import GROUPS, batch_geometry, build_parser, lr_steps
from fmeg.config import (
    context_flags,
    fp8_flags,
    fsdp_flags,
    gpt_oss_flags,
    mla_flags,
    modelopt_flags,
    mtp_flags,
)
from fmeg.config.megatron_flags import later_work_problems
from fmeg.parallel.pipeline.schedules import V_SCHEDULES
from fmeg.config.problems import Problems
from fmeg.config.layout_checks import (
    batch_problems,
    hybrid_problems,
    layout_problems,
    pipeline_problems,
    microbatches_per_step,
    virtual_chunks,
)
from fmeg.config.feature_checks import (
    moe_problems,
    optimizer_flag_problems,
    optimizer_precision_problems,
    recompute_problems,
    unused_flag_problems,
)


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
        layout_problems,
        hybrid_problems,
        pipeline_problems,
        batch_problems,
        _feature_problems,
        _run_problems,
        _optimizer_problems,
        _data_problems,
    ):
        problems.extend(part(a, world_size))
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
    problems.extend(fp8_flags.problems(a, _model_or_none(a)))
    return problems


def _model_or_none(a: argparse.Namespace):
    """The flags' model, or None where its own flags are at fault (named elsewhere)."""
    from fmeg.config.run_config import model_config

    try:
        return model_config(a, a.padded_vocab_size or 128)
    except (ValueError, TypeError, ZeroDivisionError):
        return None


def _run_problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """The checkpoints, devices, logging, recomputation and precision flags."""
    problems, need = Problems.start()
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    dp, gbs = batch_geometry(a, world_size)
    vp_chunks, microbatches = virtual_chunks(a), microbatches_per_step(a, world_size)
    v_shaped = a.pipeline_schedule in V_SCHEDULES
    if v_shaped and pp <= 1:
        problems.append(
            f"--pipeline-schedule {a.pipeline_schedule} places two stages on each pipeline rank in "
            "a V: it needs --pipeline-model-parallel-size > 1"
        )
    elif v_shaped:
        # 2 unless given otherwise (pipeline_layout.v_schedule_stages)
        need(
            vp_chunks == 2,
            f"--pipeline-schedule {a.pipeline_schedule} places two stages on each pipeline rank in "
            f"a V, got {vp_chunks}: give --num-virtual-stages-per-pipeline-rank 2 or leave it out "
            "(or a --pipeline-model-parallel-layout of 2 x pp stages)",
        )
        need(
            a.pipeline_schedule != "dualpipe_v" or not microbatches or microbatches >= 2 * pp,
            f"--pipeline-schedule dualpipe_v needs at least 2 x --pipeline-model-parallel-size "
            f"({2 * pp}) microbatches per step, got {microbatches}; raise --global-batch-size",
        )
    elif vp_chunks > 1 and microbatches:
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
    """Flags only another optimizer reads, the learning-rate warmup against the run's length, and
    the vocabulary against tp (the optimizer's and model's own flags: their groups' problems())."""
    problems, need = Problems.start()
    problems.extend(optimizer_flag_problems(a))
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
