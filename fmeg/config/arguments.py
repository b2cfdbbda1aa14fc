"""The pretraining runner's arguments: Megatron's flag names and parser rules, and an optional YAML
file.

    args = parse_args(["--tensor-model-parallel-size", "2", "--config", "run.yaml"])
    problems = validate(args, world_size=4)        # fmeg.config.validation: one line per problem

A YAML file holds the same settings by flag name (dashes or underscores); flags given on the command
line override it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from fmeg.cli import OneLineParser, refuse
from fmeg.config import moe_flags, pipeline_layout
from fmeg.config.batch_schedule import iterations_for, parse_step_schedule
from fmeg.config.checkpoint_flags import CheckpointFlags, ExitFlags
from fmeg.config.context_flags import ContextFlags
from fmeg.config.data_flags import DataFlags, SFTFlags
from fmeg.config.declare import add_group
from fmeg.config.fsdp_flags import FSDPFlags
from fmeg.config.gpt_oss_flags import GPTOSSFlags
from fmeg.config.logging_flags import LoggingFlags
from fmeg.config.megatron_flags import IgnoredFlags, LaterWorkFlags, megatron_leniencies
from fmeg.config.mla_flags import MLAFlags
from fmeg.config.model_flags import ActivationFlags, ModelFlags, PositionFlags
from fmeg.config.modelopt_flags import ModelOptFlags
from fmeg.config.moe_flags import MoEFlags
from fmeg.config.mtp_flags import MTPFlags
from fmeg.config.fp8_flags import Fp8Flags
from fmeg.config.parallel_flags import OverlapFlags, ParallelFlags
from fmeg.config.optimizer_flags import OptimizerChoiceFlags
from fmeg.config.training_flags import (
    DEFAULT_TRAIN_ITERS,
    OptimizerFlags,
    PrecisionFlags,
    TrainingFlags,
)


def batch_geometry(a: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """(data-parallel size, final global batch): dp = world / (tp * pp * cp) (at least 1), and the
    global batch defaults to one micro batch per data-parallel rank."""
    cp = max(1, getattr(a, "context_parallel_size", 1))
    dp = max(1, world_size // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size * cp))
    # its last batch is the final one, as in Megatron
    if getattr(a, "step_batch_size_schedule", None):
        try:
            return dp, parse_step_schedule(a.step_batch_size_schedule, max(a.seq_length, 1))[-1][1]
        except ValueError:
            # validate() names the problem
            pass
    return dp, a.global_batch_size or a.micro_batch_size * dp


# Every group of flags, in --help's order: each flag is declared once, as a field of one of them.
GROUPS = (
    ParallelFlags,
    OverlapFlags,
    ModelFlags,
    PositionFlags,
    ActivationFlags,
    TrainingFlags,
    OptimizerFlags,
    OptimizerChoiceFlags,
    PrecisionFlags,
    Fp8Flags,
    DataFlags,
    SFTFlags,
    CheckpointFlags,
    ExitFlags,
    LoggingFlags,
    MoEFlags,
    MLAFlags,
    MTPFlags,
    GPTOSSFlags,
    ContextFlags,
    FSDPFlags,
    ModelOptFlags,
    LaterWorkFlags,
    IgnoredFlags,
)


def build_parser() -> argparse.ArgumentParser:
    """The runner's parser, derived from the groups' declarations (and --config, the parser's
    own)."""
    p = OneLineParser(
        prog="torchrun --nproc-per-node N -m recipes.gpt_pretrain",
        description="Pretrain a GPT with any tensor/sequence/pipeline/data layout.",
    )
    p.add_argument(
        "--config", help="YAML file of settings by flag name; command-line flags override it"
    )
    for cls in GROUPS:
        add_group(p, cls)
    return p


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Flags over an optional --config YAML file, with Megatron's defaults (tp = pp = 1: every rank
    is data parallel unless told otherwise)."""
    args = as_given(argv)
    if args.use_checkpoint_args and args.load:
        from fmeg.config.checkpoint_args import apply_checkpoint_args

        problem = apply_checkpoint_args(args)
        if problem:
            refuse(problem)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if args.train_samples is not None and args.train_iters is None:
        _, gbs = batch_geometry(args, world)
        ramp = tuple(args.rampup_batch_size) if args.rampup_batch_size else None
        try:
            steps = (
                parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
                if args.step_batch_size_schedule and args.seq_length > 0
                else None
            )
        except ValueError:
            # validate() names the problem
            steps = None
        args.train_iters = iterations_for(args.train_samples, gbs, ramp, steps) if gbs > 0 else 0
    elif args.train_iters is None:
        args.train_iters = DEFAULT_TRAIN_ITERS
    args.notices = megatron_leniencies(args) + moe_flags.leniencies(args)
    args.notices += pipeline_layout.v_schedule_stages(args)
    # validate() names them
    args.layout_problems = pipeline_layout.apply(args)
    from fmeg.config.checkpoint_args import router_without_bias

    older = router_without_bias(args)
    if older:
        args.notices.append(older)
    return args


def _given_on_command_line(argv: list[str] | None) -> set[str]:
    """The destinations of the flags given on the command line (a parse in which nothing has a
    default)."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_known_args(argv)[0]))


def as_given(argv: list[str] | None) -> argparse.Namespace:
    """The flags over the --config file, as given: before Megatron's adjustments and the values
    derived from others (parse_args). args.given: the dests given, even at their default values."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    from_yaml = load_config(first.config, parser) if first.config else {}
    parser.set_defaults(**from_yaml)
    args = parser.parse_args(argv)
    args.given = tuple(sorted({*from_yaml, *_given_on_command_line(argv)}))
    return args


def load_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The YAML file's settings by flag name, each typed as its flag types it (a switch takes only
    true or false, a number only a number, null nothing); any problem ends the run with one line."""
    import yaml

    if not Path(path).is_file():
        refuse(f"--config {path}: no such file")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    # syntax errors, and !!python tags safe_load refuses
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        refuse(f"--config {path}: not readable YAML ({' '.join(str(e).split())[:200]})")
    if not isinstance(data, dict):
        refuse(f"--config {path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions}
    settings = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions or dest in ("config", "help"):
            refuse(
                f"--config {path}: unknown setting {key!r} (use the flag's name, e.g. num-layers)"
            )
        settings[dest] = _typed(actions[dest], value, f"--config {path}: {key}")
    return settings


def _typed(action: argparse.Action, value: Any, where: str) -> Any:
    if value is None:
        refuse(f"{where} is null; give a value or leave the setting out")
    # a switch
    if action.nargs == 0:
        if not isinstance(value, bool):
            refuse(f"{where}: {value!r} is not true or false")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            refuse(f"{where}: expected {action.nargs} values, got {value!r}")
        return [_scalar(action, item, where) for item in items]
    if isinstance(value, (list, dict)):
        refuse(f"{where}: expected one value, got {value!r}")
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type or str
    if (
        isinstance(value, bool)
        or isinstance(value, (list, dict))
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        refuse(f"{where}: {value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
    try:
        value = kind(value)
    except (TypeError, ValueError):
        refuse(f"{where}: {value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
    if action.choices is not None and value not in action.choices:
        refuse(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def lr_steps(a: argparse.Namespace) -> tuple[float, int, bool]:
    """(warmup, decay, counted_in_samples) of the learning-rate schedule, as Megatron derives them:
    in samples when --train-samples or --lr-decay-samples is given (decay defaults to
    --train-samples, warmup to 0), else in iterations; --lr-warmup-fraction is a fraction of
    decay."""
    in_samples = a.lr_decay_samples is not None or a.train_samples is not None
    if in_samples:
        decay = a.lr_decay_samples or a.train_samples
    else:
        decay = a.lr_decay_iters or a.train_iters
    # a fraction of a step stays a fraction, as in Megatron
    if a.lr_warmup_fraction is not None:
        return a.lr_warmup_fraction * decay, decay, in_samples
    return ((a.lr_warmup_samples or 0) if in_samples else a.lr_warmup_iters), decay, in_samples
