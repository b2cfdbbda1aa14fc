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
import re

# far more symbols than any model has layers: a repetition past it is refused before it is written
# out
MAX_SYMBOLS = 100_000
_TOKEN = re.compile(r"\s*(?:(?P<symbol>[EtmL|])|(?P<open>\()|(?P<close>\))|\*\s*(?P<times>\d+))")


def expand(text: str) -> str:
    """The layout with every repetition written out and the commas dropped ("Et*2|(t|)*2L" ->
    "Ett|t|t|L"); ValueError naming what it cannot read."""
    text = text.replace(",", "")
    pos, stack = 0, [[]]
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"cannot read {text[pos:]!r}: use E, t, m, L, |, (...) and *N")
        pos = m.end()
        if m["symbol"]:
            stack[-1].append(m["symbol"])
        elif m["open"]:
            stack.append([])
        elif m["close"]:
            if len(stack) == 1:
                raise ValueError("a ')' closes no '('")
            group = "".join(stack.pop())
            stack[-1].append(group)
        else:
            if not stack[-1]:
                raise ValueError(f"'*{m['times']}' repeats nothing")
            if len(stack[-1][-1]) * int(m["times"]) > MAX_SYMBOLS:
                raise ValueError(
                    f"'{stack[-1][-1][:20]}'*{m['times'][:20]} writes out more than {MAX_SYMBOLS} "
                    "symbols, more than any model has layers"
                )
            stack[-1][-1] *= int(m["times"])
    if len(stack) != 1:
        raise ValueError("a '(' is not closed")
    return "".join(stack[0])


def stages(text: str) -> list[str]:
    """Each stage's symbols, in forward order."""
    return expand(text).split("|")


def layout_stage_layers(text: str, num_layers: int, mtp_layers: int, pp: int) -> tuple[int, ...]:
    """The decoder layers of each stage of a layout string, in forward order; ValueError naming
    what fmeg's pipeline cannot hold."""
    held = stages(text)
    if len(held) % pp:
        raise ValueError(
            f"its {len(held)} stages are not a multiple of --pipeline-model-parallel-size {pp}"
        )
    counts = {symbol: "".join(held).count(symbol) for symbol in "EtmL"}
    if (
        counts["t"] != num_layers
        or counts["m"] != mtp_layers
        or counts["E"] != 1
        or counts["L"] != 1
    ):
        raise ValueError(
            f"it holds {counts['E']} E, {counts['t']} t, {counts['m']} m and {counts['L']} L; the "
            f"model has one embedding, {num_layers} decoder layers, {mtp_layers} MTP layers and "
            "one loss"
        )
    if not held[0].startswith("E"):
        raise ValueError("the embedding (E) comes first in the first stage")
    if not held[-1].endswith("m" * mtp_layers + "L"):
        raise ValueError(
            "fmeg's pipeline keeps the MTP layers (m) and the loss (L) at the end of the last stage"
        )
    return tuple(stage.count("t") for stage in held)


def flag_stage_layers(
    num_layers: int,
    pp: int,
    vp: int,
    first: int | None,
    last: int | None,
    embedding: bool,
    loss: bool,
) -> tuple[int, ...]:
    """The decoder layers of each of the pp x vp stages as Megatron's --decoder-first/last-pipeline-
    num-layers and --account-for-embedding/loss-in-pipeline-split place them (each rank's layers
    split evenly over its vp virtual stages, the ranks between first and last holding equal
    shares; an accounted embedding or loss takes a layer's place in the first or last stage);
    ValueError naming what does not divide."""
    if first is not None or last is not None:
        if embedding or loss:
            raise ValueError(
                "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-split "
                "are alternatives (Megatron's rule): give one"
            )
        if pp < 2:
            raise ValueError(
                "an uneven first or last stage needs --pipeline-model-parallel-size > 1"
            )
        ends = [n for n in (first, last) if n is not None]
        if min(ends) < 1:
            raise ValueError("the first and last pipeline ranks hold at least one layer")
        middle_ranks = pp - len(ends)
        middle_layers = num_layers - sum(ends)
        if middle_layers < 0 or bool(middle_ranks) != bool(middle_layers):
            raise ValueError(
                f"the first and last ranks' {ends} of the {num_layers} layers leave "
                f"{middle_layers} for the {middle_ranks} ranks between them (each needs some, "
                "and none may be left over)"
            )
        if middle_ranks and middle_layers % middle_ranks:
            raise ValueError(
                f"the {middle_layers} layers left do not split evenly over the {middle_ranks} "
                "pipeline ranks between the first and the last"
            )
        per_rank = [middle_layers // middle_ranks if middle_ranks else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = num_layers + embedding + loss
        if total % pp:
            raise ValueError(
                f"the {num_layers} layers{' + embedding' * embedding}{' + loss' * loss} = {total} "
                f"do not split evenly over --pipeline-model-parallel-size {pp}"
            )
        per_rank = [total // pp] * pp
    uneven = [n for n in per_rank if n % vp]
    if uneven:
        raise ValueError(
            f"a pipeline rank's {uneven[0]} layers do not split evenly over its {vp} virtual stages"
        )
    counts = [per_rank[rank] // vp for _ in range(vp) for rank in range(pp)]
    counts[0] -= embedding
    counts[-1] -= loss
    if min(counts) < 0:
        raise ValueError("the first or last stage has no layer to give to the embedding or loss")
    return tuple(counts)


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
            if getattr(a, name) not in (None, False)
        ]
        return [f"{' '.join(names)}: {e}"]
    return []


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
