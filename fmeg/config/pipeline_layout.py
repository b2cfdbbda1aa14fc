"""Megatron's --pipeline-model-parallel-layout: a string naming what each pipeline stage holds.

    "Et*3|(tt|)*29,m|L"
        stages split by "|", in forward order (all pp ranks' first virtual stage, then their
                            second...); E the embedding, t a decoder layer, m a multi-token
                                prediction layer, L the
                            loss; X*N and (...)*N repeat; commas are cosmetic; a stage may be empty

The number of stages is pp x the virtual stages per rank. fmeg's pipeline holds the same number of
decoder layers on every stage, the embedding on the first and the MTP layers with the loss on the
last: a layout that says so sets --num-layers-per-virtual-pipeline-stage; any other is refused in
one line naming the stage that differs. --num-virtual-stages-per-pipeline-rank N sets it too: each
rank's layers split into N equal virtual stages.
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


def layers_per_stage(text: str, num_layers: int, mtp_layers: int, pp: int) -> int:
    """The decoder layers of every stage of a layout fmeg's pipeline holds; ValueError naming what
    differs."""
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
        raise ValueError("fmeg's pipeline keeps the embedding at the start of the first stage")
    if not held[-1].endswith("m" * mtp_layers + "L"):
        raise ValueError(
            "fmeg's pipeline keeps the MTP layers and the loss at the end of the last stage"
        )
    per = num_layers // len(held)
    uneven = [i for i, s in enumerate(held) if s.count("t") != per]
    if uneven or num_layers % len(held):
        i = uneven[0] if uneven else 0
        raise ValueError(
            f"stage {i} holds {held[i].count('t')} decoder layers; fmeg's pipeline splits the "
            f"{num_layers} evenly over the {len(held)} stages (uneven stages are not supported yet)"
        )
    return per


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
    if a.num_layers <= 0 or pp <= 0 or a.num_layers % pp:
        # validate() names the layers that do not split over pp
        return []
    per_rank = a.num_layers // pp
    if n < 1 or per_rank % n:
        return [
            f"--num-virtual-stages-per-pipeline-rank {n} must divide the {per_rank} decoder layers "
            "of each pipeline rank (fmeg's stages hold equal numbers of layers)"
        ]
    if n > 1:
        a.num_layers_per_virtual_pipeline_stage = per_rank // n
    return []


def apply(a: argparse.Namespace) -> list[str]:
    """Set --num-layers-per-virtual-pipeline-stage from the layout (in place); its problems, one
    line each."""
    if a.num_virtual_stages_per_pipeline_rank is not None:
        return _virtual_stages(a)
    text = a.pipeline_model_parallel_layout
    if text is None:
        return []
    if a.num_layers_per_virtual_pipeline_stage is not None:
        return [
            "--pipeline-model-parallel-layout sets the virtual stages: drop "
            "--num-layers-per-virtual-pipeline-stage"
        ]
    try:
        per = layers_per_stage(
            text, a.num_layers, a.mtp_num_layers or 0, a.pipeline_model_parallel_size
        )
    except ValueError as e:
        return [f"--pipeline-model-parallel-layout {text!r}: {e}"]
    if len(stages(text)) > a.pipeline_model_parallel_size:
        a.num_layers_per_virtual_pipeline_stage = per
    return []
