"""Megatron's context-parallel flags: their parser group, the layout they set, and their rules."""

from __future__ import annotations

import argparse

from fmeg.config.declare import flag, group

COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]


@group("context parallelism")
class ContextFlags:
    """How the context-parallel ranks split and exchange the sequence."""

    context_parallel_size: int = flag(
        "--context-parallel-size",
        type=int,
        default=1,
        help="ranks that split each sequence between them (long contexts): rank r holds chunks r "
        "and 2cp-1-r of 2cp",
    )
    cp_comm_type: list[str] = flag(
        "--cp-comm-type",
        nargs="+",
        choices=COMM_TYPES,
        default=["p2p"],
        help="how attention reaches the other ranks' keys: p2p (ring), all_gather, a2a (Ulysses), "
        "a2a+p2p (Ulysses within groups of consecutive cp ranks, a ring between them); one value, "
        "or one per layer",
    )
    hierarchical_context_parallel_sizes: list[int] | None = flag(
        "--hierarchical-context-parallel-sizes",
        type=int,
        nargs="+",
        help="a2a+p2p's two levels: the a2a group size, then the p2p ring's (their product: "
        "--context-parallel-size)",
    )


def comm_type(a: argparse.Namespace) -> str | tuple[str, ...]:
    """The comm type of every layer: one value, or a tuple with one per layer (Megatron's list
    form)."""
    types = a.cp_comm_type
    return types[0] if len(set(types)) == 1 else tuple(types)


def a2a_level(a: argparse.Namespace) -> int:
    """The size of a2a+p2p's a2a level (1 without --hierarchical-context-parallel-sizes)."""
    sizes = a.hierarchical_context_parallel_sizes
    return sizes[0] if sizes else 1


def problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """One line for each context-parallel flag that cannot run (Megatron's rules)."""
    cp, tp, pp = (
        a.context_parallel_size,
        a.tensor_model_parallel_size,
        a.pipeline_model_parallel_size,
    )
    out = []
    if cp < 1:
        return [f"--context-parallel-size must be positive, got {cp}"]
    types = a.cp_comm_type
    if len(types) not in (1, a.num_layers):
        out.append(
            f"--cp-comm-type: {len(types)} values for --num-layers {a.num_layers}; give one, or "
            "one per layer"
        )
    levels = a.hierarchical_context_parallel_sizes
    if levels is not None and (len(levels) != 2 or min(levels) < 1 or levels[0] * levels[1] != cp):
        out.append(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, levels))}: give two "
            "positive sizes, the a2a level's then the p2p level's, whose product is "
            f"--context-parallel-size {cp}"
        )
        levels = None
    if "a2a+p2p" in types and levels is None and a.hierarchical_context_parallel_sizes is None:
        out.append(
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the a2a "
            f"group size, then the p2p ring's; A x P = --context-parallel-size {cp})"
        )
    if cp == 1:
        return out
    if world_size % (tp * pp * cp):
        out.append(
            f"world size {world_size} must be divisible by --tensor-model-parallel-size * "
            f"--pipeline-model-parallel-size * --context-parallel-size = {tp} * {pp} * {cp}"
        )
    chunk = 2 * cp * (tp if a.sequence_parallel else 1)
    if a.seq_length % chunk:
        out.append(
            f"--seq-length {a.seq_length} must be divisible by 2 x --context-parallel-size"
            + (" x --tensor-model-parallel-size (sequence parallel)" if a.sequence_parallel else "")
            + f" = {chunk}"
        )
    heads = a.num_attention_heads
    groups = a.num_query_groups if a.group_query_attention and a.num_query_groups else heads
    for kind, split, by in (
        ("a2a", cp, f"--context-parallel-size {cp}"),
        ("a2a+p2p", levels[0] if levels else 1, "its a2a level"),
    ):
        if kind in types and ((heads // tp) % split or (groups // tp) % split):
            out.append(
                f"--cp-comm-type {kind} splits heads over {by}: {heads} attention heads and "
                f"{groups} query groups per tensor-parallel rank ({heads // tp}, {groups // tp}) "
                f"must be divisible by {split}"
            )
    return out
