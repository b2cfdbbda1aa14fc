"""How Megatron splits a decoder's layers over pipeline stages: its layout string
(--pipeline-model-parallel-layout, "Et*3|(tt|)*29,m|L") and its uneven-split flags
(--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split), as the
decoder layers of each stage in forward order (all pp ranks' first virtual stage, then their
second...). Pure functions of the numbers; fmeg/config/pipeline_layout.py reads the flags with
them, fmeg/interop/megatron a checkpoint's saved args.

    layout_stage_layers("Et|tt|t|tL", num_layers=5, mtp_layers=0, pp=2)   # (1, 2, 1, 1)
    flag_stage_layers(8, pp=4, vp=1, first=1, last=1, embedding=False, loss=False)
"""

from __future__ import annotations

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
