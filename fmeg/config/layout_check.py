"""The runs of a layout check (python -m fmeg.check): the user's flags, shrunk and made safe, at one
rank and at each layout they allow.

    plan = layout_check.plan(argv, layouts=None, iterations=5)
    plan.reference.argv, [row.name for row in plan.rows]      # "tp2", "pp2-vp2", "dp2-zero", ...

A layout's name joins its parts with "-": tp<N>, pp<N>, vp<N> (virtual stages per pipeline rank),
cp<N>, dp<N>, ep<N>, etp<N>, and sp (sequence parallelism), zero (the distributed optimizer), fsdp
(parameters, gradients and optimizer state sharded over data parallelism). Its world is
tp x pp x cp x dp. Everything is settled here, from the flags alone: the runs start only when every
row's flags are valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fmeg.config.arguments import as_given, build_parser, parse_args
from fmeg.config.training_flags import DEFAULT_TRAIN_ITERS
from fmeg.config.validation import validate

# the layout the user's own run had: every row sets its own
LAYOUT_DESTS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "hierarchical_context_parallel_sizes",
    "sequence_parallel",
    "use_distributed_optimizer",
    "use_megatron_fsdp",
    "use_torch_fsdp2",
    "data_parallel_sharding_strategy",
    "num_distributed_optimizer_instances",
)
# what a check must not touch or wait for: the user's checkpoints, loggers and exits
OUTSIDE_DESTS = (
    "save",
    "load",
    "save_interval",
    "use_checkpoint_args",
    "finetune",
    "async_save",
    "exit_on_missing_checkpoint",
    "tensorboard_dir",
    "wandb_project",
    "wandb_exp_name",
    "wandb_save_dir",
    "wandb_entity",
    "log_dir",
    "exit_interval",
    "exit_duration_in_mins",
    "exit_signal_handler",
    "eval_interval",
    "train_samples",
    "rampup_batch_size",
    "step_batch_size_schedule",
)
# the model's sizes, shrunk to at most these
SMALL = {
    "num_layers": 4,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_head_dim": 16,
    "qk_pos_emb_head_dim": 8,
    "v_head_dim": 16,
    "mtp_num_layers": 1,
    "global_batch_size": 8,
    "micro_batch_size": 1,
}
# shrunk even when not given: every model has them
ALWAYS_SHRUNK = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "micro_batch_size",
)
# the layouts tried when none are named, the smallest first
DEFAULT_LAYOUTS = (
    "tp2",
    "tp2-sp",
    "pp2",
    "pp2-vp2",
    "dp2",
    "dp2-zero",
    "dp2-fsdp",
    "cp2",
    "dp2-ep2",
    "tp2-pp2",
    "tp2-dp2-zero",
    "pp2-dp2-ep2",
    "cp2-dp2-zero",
)
_SIZED = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "vp": "num_virtual_stages_per_pipeline_rank",
    "dp": None,
}
_SWITCHES = {
    "sp": {"sequence_parallel": True},
    "zero": {"use_distributed_optimizer": True},
    "fsdp": {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
}


class PlanError(ValueError):
    """Lines naming what is wrong with the flags or the layouts asked for."""

    def __init__(self, *lines: str):
        super().__init__(lines[0])
        self.lines = lines


@dataclass(frozen=True)
class Row:
    # "tp2-pp2"; "1 rank" for the reference
    name: str
    world: int
    # the runner's flags (its --log-dir is the caller's)
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    reference: Row
    rows: tuple[Row, ...]
    # "--num-layers 32 -> 4", one per flag shrunk
    shrank: tuple[str, ...]
    # other changes to the user's flags, each with why
    changed: tuple[str, ...]
    # "cp2: <the first problem>" for each default layout the flags do not allow
    not_run: tuple[str, ...]


def layout_settings(name: str) -> tuple[int, dict[str, Any]]:
    """(world, {dest: value}) of a layout's name; PlanError for a name that is not one."""
    world, settings = 1, {}
    for part in name.split("-"):
        sized = re.fullmatch(r"(tp|pp|cp|ep|etp|vp|dp)([1-9][0-9]*)", part)
        if sized:
            kind, size = sized[1], int(sized[2])
            if kind in ("tp", "pp", "cp", "dp"):
                world *= size
            if _SIZED[kind]:
                settings[_SIZED[kind]] = size
        elif part in _SWITCHES:
            settings |= _SWITCHES[part]
        else:
            raise PlanError(
                f"--layouts {name}: {part!r} is not a layout part (tp<N>, pp<N>, vp<N>, cp<N>, "
                "dp<N>, ep<N>, etp<N>, sp, zero, fsdp joined by '-', e.g. tp2-pp2)"
            )
    return world, settings


def plan(
    argv: list[str],
    *,
    layouts: list[str] | None = None,
    iterations: int = 5,
    shrink: bool = True,
    keep_precision: bool = False,
    max_ranks: int = 4,
) -> Plan:
    """The check's runs of the user's flags argv, or PlanError naming every problem."""
    settings = given_settings(argv)
    settings, shrank, changed = _made_safe(settings, iterations, shrink, keep_precision)
    reference = _row("1 rank", 1, settings)
    problems = _problems(reference) or _load_problems(reference)
    if problems:
        raise PlanError(*problems)
    rows, not_run = [], []
    for name in layouts or DEFAULT_LAYOUTS:
        world, layout = layout_settings(name)
        # expert parallelism is tried only on a model with experts
        dense = not settings.get("num_experts") and "ep" in name
        if (world > max_ranks or dense) and not layouts:
            continue
        if world > max_ranks:
            raise PlanError(
                f"--layouts {name}: {world} ranks, above --max-ranks {max_ranks} (each rank is a "
                "process on this machine; raise --max-ranks to run it)"
            )
        row = _row(name, world, settings | layout)
        problems = _problems(row)
        if problems and layouts:
            raise PlanError(*(f"--layouts {name}: {p}" for p in problems))
        if problems:
            not_run.append(f"{name}: {problems[0]}")
        else:
            rows.append(row)
    if not rows:
        raise PlanError(
            f"no layout to compare with one rank within --max-ranks {max_ranks}"
            + (f": {'; '.join(not_run)}" if not_run else "")
        )
    return Plan(reference, tuple(rows), tuple(shrank), tuple(changed), tuple(not_run))


def given_settings(argv: list[str]) -> dict[str, Any]:
    """{dest: value} of every flag the user gave, on the command line or in a --config file, as
    given (the runner adjusts them again)."""
    a = as_given(argv)
    return {dest: getattr(a, dest) for dest in a.given}


def argv_of(settings: dict[str, Any]) -> list[str]:
    """The command line that gives these settings ({dest: value}), each flag once."""
    by_dest: dict[str, list] = {}
    for action in build_parser()._actions:
        by_dest.setdefault(action.dest, []).append(action)
    argv: list[str] = []
    for dest, value in settings.items():
        argv += _flag_of(by_dest[dest], value)
    return argv


def _flag_of(actions: list, value: Any) -> list[str]:
    """The tokens of one dest's value, through the action that sets it to that value."""
    kinds = {type(a).__name__: a for a in actions}
    if "BooleanOptionalAction" in kinds:
        flag = kinds["BooleanOptionalAction"].option_strings[0]
        return [] if value is None else [flag if value else "--no-" + flag.removeprefix("--")]
    if "_StoreTrueAction" in kinds or "_StoreFalseAction" in kinds:
        on, off = kinds.get("_StoreTrueAction"), kinds.get("_StoreFalseAction")
        chosen = on if value else off
        return [chosen.option_strings[0]] if chosen is not None else []
    action = kinds["_StoreAction"]
    if value is None:
        return []
    flag = action.option_strings[0]
    if action.nargs is None:
        if isinstance(value, (list, tuple)):
            return [flag, "[" + ",".join(str(v) for v in value) + "]"]
        return [flag, str(value)]
    return [flag, *(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))]


def _made_safe(
    settings: dict[str, Any], iterations: int, shrink: bool, keep_precision: bool
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The user's settings without their layout and outside effects, shrunk, run for `iterations`
    on CPU; with what was shrunk and what else changed."""

    def given(dests: tuple[str, ...]) -> str:
        return ", ".join(_flag(d) for d in dests if settings.get(d) not in (None, False))

    changed = []
    if given(LAYOUT_DESTS):
        changed.append(f"each row sets its own layout: left out {given(LAYOUT_DESTS)}")
    if given(OUTSIDE_DESTS):
        changed.append(
            f"left out {given(OUTSIDE_DESTS)}: a check reads and writes no checkpoint, logs only "
            "to its own directory and runs a fixed number of iterations"
        )
    # a --config file's settings are in settings already: each row gives them as flags
    out = {k: v for k, v in settings.items() if k not in LAYOUT_DESTS + OUTSIDE_DESTS + ("config",)}
    shrank = []
    if shrink:
        out, shrank = _shrunk(out)
    if not keep_precision and (out.pop("bf16", False) | out.pop("fp16", False)):
        changed.append(
            "ran in fp32: bf16 and fp16 round differently at each layout (--keep-precision keeps "
            "them)"
        )
    muon = out.get("optimizer") in ("muon", "dist_muon", "adaptive_muon")
    if not keep_precision and muon and out.get("muon_fp32_matmul_prec") != "high":
        out["muon_fp32_matmul_prec"] = "high"
        changed.append(
            "Newton-Schulz in fp32 (--muon-fp32-matmul-prec high): its bf16 steps round "
            "differently at each layout (--keep-precision keeps them)"
        )
    if "global_batch_size" not in out:
        # Megatron's default, one micro batch per data-parallel rank, would differ by layout
        micro = out.get("micro_batch_size") or _default("micro_batch_size")
        out["global_batch_size"] = micro * 8
        changed.append(f"--global-batch-size {out['global_batch_size']}, the same at every layout")
    out, scheduled = _schedule_shrunk(out, settings, iterations)
    shrank += scheduled
    out |= {"eval_iters": 0, "device": "cpu", "log_interval": iterations}
    return out, shrank, changed


def _schedule_shrunk(
    out: dict[str, Any], given: dict[str, Any], iterations: int
) -> tuple[dict[str, Any], list[str]]:
    """The run's length set to the check's iterations, and its learning-rate warmup and decay
    scaled with it (the same fractions of the run, in iterations, the warmup below the decay), each
    change named. given: the user's settings, --train-samples among them."""
    out, said = dict(out), []
    length, unit = given.get("train_iters"), "iterations"
    if given.get("train_samples") is not None:
        length, unit = given["train_samples"], "samples"
    elif given.get("lr_decay_samples") is not None:
        length, unit = given["lr_decay_samples"], "samples"
    length = length or DEFAULT_TRAIN_ITERS
    if given.get("train_iters") not in (None, iterations):
        said.append(f"--train-iters {given['train_iters']} -> {iterations}")
    elif given.get("train_samples") is not None:
        said.append(f"--train-samples {given['train_samples']} -> --train-iters {iterations}")
    out["train_iters"] = iterations

    def scaled(value: int) -> int:
        return round(value * iterations / length)

    decay_dest = "lr_decay_samples" if unit == "samples" else "lr_decay_iters"
    decay = iterations
    if out.get(decay_dest) is not None:
        value = out.pop(decay_dest)
        decay = max(1, scaled(value))
        out["lr_decay_iters"] = decay
        said.append(f"{_renamed(decay_dest, 'lr_decay_iters', value)}{decay}")
    warmup_dest = "lr_warmup_samples" if unit == "samples" else "lr_warmup_iters"
    if out.get(warmup_dest) and out.get("lr_warmup_fraction") is None:
        value = out.pop(warmup_dest)
        # a warmup as long as the decay would leave no decay to compare
        warmup = min(scaled(value), decay - 1)
        out["lr_warmup_iters"] = warmup
        said.append(f"{_renamed(warmup_dest, 'lr_warmup_iters', value)}{warmup}")
    return out, said


def _shrunk(settings: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out, said = dict(settings), []
    for dest, small in SMALL.items():
        # the base model's defaults larger than small are shrunk too (the micro batch of 4)
        value = out.get(dest, _default(dest) if dest in ALWAYS_SHRUNK else None)
        if isinstance(value, int) and value > small:
            out[dest] = small
            said.append(f"{_flag(dest)} {value} -> {small}")
    freq = out.get("moe_layer_freq")
    layers = out.get("num_layers")
    if isinstance(freq, (list, tuple)) and layers and len(freq) > layers:
        # the pattern's kinds kept: a dense first layer stays dense
        out["moe_layer_freq"] = [freq[0]] + [1] * (layers - 1)
        said.append(f"--moe-layer-freq of {len(freq)} layers -> {out['moe_layer_freq']}")
    comm = out.get("cp_comm_type")
    if isinstance(comm, (list, tuple)) and layers and len(comm) > layers:
        out["cp_comm_type"] = list(comm[:layers])
        said.append(f"--cp-comm-type of {len(comm)} layers -> its first {layers}")
    return out, said


def _row(name: str, world: int, settings: dict[str, Any]) -> Row:
    return Row(name, world, tuple(argv_of(settings)))


def _problems(row: Row) -> list[str]:
    a = parse_args(list(row.argv), world_size=row.world)
    return validate(a, row.world)


def _renamed(dest: str, to: str, value: Any) -> str:
    """ "--flag value ->", with the new flag where it is another one."""
    return f"{_flag(dest)} {value} -> " + ("" if dest == to else f"{_flag(to)} ")


def _load_problems(row: Row) -> list[str]:
    """What the runner's load finds beyond the flags' rules (a tokenizer file that is missing or
    unreadable, a padded vocabulary too small), before any row starts."""
    from fmeg.config.load import BadInput, load

    try:
        load(list(row.argv), row.world)
    except BadInput as e:
        return list(e.lines)
    return []


def _default(dest: str) -> Any:
    return build_parser().get_default(dest)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def describe(plan: Plan) -> list[str]:
    """What the check changed and will run, a line each."""
    lines = [f"shrank {'; '.join(plan.shrank)}"] if plan.shrank else []
    lines += plan.changed
    lines += [f"not run: {line}" for line in plan.not_run]
    worlds = sorted({row.world for row in plan.rows})
    lines.append(
        f"layouts: {', '.join(row.name for row in plan.rows)} (worlds {worlds}), against 1 rank"
        if plan.rows
        else "layouts: none the flags allow"
    )
    return lines
