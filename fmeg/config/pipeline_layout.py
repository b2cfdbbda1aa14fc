"""Megatron's --pipeline-model-parallel-layout: a string naming what each pipeline stage holds.

    "Et*3|(tt|)*29,m|L"
        stages split by "|", in forward order (all pp ranks' first virtual stage, then their
                            second...); E the embedding, t a decoder layer, m a multi-token
                                prediction layer, L the
                            loss; X*N and (...)*N repeat; commas are cosmetic; a stage may be empty

The number of stages is pp x the virtual stages per rank. Stages may hold any number of decoder
layers, none included (Megatron's uneven layouts); fmeg keeps the embedding at the start of the
first stage and the MTP layers with the loss at the end of the last, as Megatron's own layouts do.
--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split give
uneven stages too, by Megatron's rules; --num-virtual-stages-per-pipeline-rank N splits each rank's
layers into N virtual stages.
"""

from __future__ import annotations

import argparse

from fmeg.parallel.pipeline.schedules import V_SCHEDULES
from fmeg.parallel.pipeline.stage_layers import flag_stage_layers, layout_stage_layers


def _uneven_flags(a: argparse.Namespace) -> bool:
    return (
        a.decoder_first_pipeline_num_layers is not None
        or a.decoder_last_pipeline_num_layers is not None
        or a.account_for_embedding_in_pipeline_split
        or a.account_for_loss_in_pipeline_split
    )


def _from_flags(a: argparse.Namespace) -> tuple[int, ...]:
    """The stages the uneven-split flags give (ValueError: why not)."""
    pp, vp = a.pipeline_model_parallel_size, a.num_virtual_stages_per_pipeline_rank or 1
    if a.num_layers_per_virtual_pipeline_stage is not None:
        if a.decoder_first_pipeline_num_layers is not None or (
            a.decoder_last_pipeline_num_layers is not None
        ):
            raise ValueError(
                "give the virtual stages with --num-virtual-stages-per-pipeline-rank when the "
                "first or last stage is uneven (Megatron's rule)"
            )
        total = a.num_layers + a.account_for_embedding_in_pipeline_split
        total += a.account_for_loss_in_pipeline_split
        per_virtual = a.num_layers_per_virtual_pipeline_stage
        if per_virtual <= 0 or pp <= 0 or total % pp or (total // pp) % per_virtual:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {per_virtual} must divide the "
                f"{total} // {pp} layers each pipeline rank holds (the embedding and loss counted)"
            )
        vp = total // pp // per_virtual
    return flag_stage_layers(
        a.num_layers,
        pp,
        vp,
        a.decoder_first_pipeline_num_layers,
        a.decoder_last_pipeline_num_layers,
        a.account_for_embedding_in_pipeline_split,
        a.account_for_loss_in_pipeline_split,
    )


def _set_stages(a: argparse.Namespace, counts: tuple[int, ...]) -> None:
    """Even stages as --num-layers-per-virtual-pipeline-stage (what the rest of the flags read),
    uneven ones as a.pipeline_stage_layers."""
    pp = a.pipeline_model_parallel_size
    if len(set(counts)) == 1:
        a.num_layers_per_virtual_pipeline_stage = counts[0] if len(counts) > pp else None
    else:
        a.num_layers_per_virtual_pipeline_stage = None
        a.pipeline_stage_layers = counts


def _virtual_stages(a: argparse.Namespace) -> list[str]:
    """--num-virtual-stages-per-pipeline-rank N as the layers per virtual stage it means (in
    place)."""
    n, pp = a.num_virtual_stages_per_pipeline_rank, a.pipeline_model_parallel_size
    if (
        a.num_layers_per_virtual_pipeline_stage is not None
        or a.pipeline_model_parallel_layout is not None
    ):
        return [
            "--num-virtual-stages-per-pipeline-rank, --num-layers-per-virtual-pipeline-stage and "
            "--pipeline-model-parallel-layout are alternatives; give one"
        ]
    if _uneven_flags(a):
        return _flag_problems(a)
    if a.num_layers <= 0 or pp <= 0 or a.num_layers % pp:
        # validate() names the layers that do not split over pp
        return []
    per_rank = a.num_layers // pp
    if n < 1 or per_rank % n:
        return [
            f"--num-virtual-stages-per-pipeline-rank {n} must divide the {per_rank} decoder layers "
            "of each pipeline rank (or give --decoder-first/last-pipeline-num-layers)"
        ]
    if n > 1:
        a.num_layers_per_virtual_pipeline_stage = per_rank // n
    return []


def _flag_problems(a: argparse.Namespace) -> list[str]:
    try:
        _set_stages(a, _from_flags(a))
    except ValueError as e:
        names = [
            f"--{name.replace('_', '-')}"
            + (f" {getattr(a, name)}" if not isinstance(getattr(a, name), bool) else "")
            for name in (
                "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split",
            )
            # 0 is a count given (0 == False, so `not in (None, False)` would drop it)
            if getattr(a, name) is not None and getattr(a, name) is not False
        ]
        return [f"{' '.join(names)}: {e}"]
    return []


def v_schedule_stages(a: argparse.Namespace) -> list[str]:
    """A V schedule (--pipeline-schedule zero_bubble_v or dualpipe_v) places exactly two virtual
    stages on each pipeline rank: --num-virtual-stages-per-pipeline-rank 2 when nothing else gives
    the virtual stages (in place), and the start line's notice that says so. A value given stays
    (validate() refuses any other than 2)."""
    if (
        a.pipeline_schedule not in V_SCHEDULES
        or a.pipeline_model_parallel_size <= 1
        or a.num_virtual_stages_per_pipeline_rank is not None
        or a.num_layers_per_virtual_pipeline_stage is not None
        or a.pipeline_model_parallel_layout is not None
    ):
        return []
    a.num_virtual_stages_per_pipeline_rank = 2
    return [
        f"--pipeline-schedule {a.pipeline_schedule} places two stages on each pipeline rank in a "
        "V: --num-virtual-stages-per-pipeline-rank 2 set"
    ]


def apply(a: argparse.Namespace) -> list[str]:
    """Set the stages from the layout string, the uneven-split flags or the virtual stages (in
    place: --num-layers-per-virtual-pipeline-stage when every stage holds as many decoder layers,
    a.pipeline_stage_layers when they differ); their problems, one line each."""
    a.pipeline_stage_layers = None
    if a.num_virtual_stages_per_pipeline_rank is not None:
        return _virtual_stages(a)
    text = a.pipeline_model_parallel_layout
    if text is None:
        return _flag_problems(a) if _uneven_flags(a) else []
    if a.num_layers_per_virtual_pipeline_stage is not None or _uneven_flags(a):
        return [
            "--pipeline-model-parallel-layout places every layer: drop "
            "--num-layers-per-virtual-pipeline-stage, --decoder-first/last-pipeline-num-layers "
            "and --account-for-*-in-pipeline-split"
        ]
    try:
        counts = layout_stage_layers(
            text, a.num_layers, a.mtp_num_layers or 0, a.pipeline_model_parallel_size
        )
    except ValueError as e:
        return [f"--pipeline-model-parallel-layout {text!r}: {e}"]
    _set_stages(a, counts)
    return []
