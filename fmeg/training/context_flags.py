"""Megatron's context-parallel flags: their parser group, the layout they set, and their rules."""

from __future__ import annotations

import argparse

COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("context parallelism")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that split each sequence between them (long contexts): rank r holds chunks r and "
                        "2cp-1-r of 2cp")
    g.add_argument("--cp-comm-type", nargs="+", choices=COMM_TYPES, default=["p2p"],
                   help="how attention reaches the other ranks' keys: p2p (ring), all_gather, a2a (Ulysses); one "
                        "value, or one per layer")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
                   help="the a2a and p2p group sizes of a2a+p2p")


def comm_type(a: argparse.Namespace) -> str | tuple[str, ...]:
    """The comm type of every layer: one value, or a tuple with one per layer (Megatron's list form)."""
    types = a.cp_comm_type
    return types[0] if len(set(types)) == 1 else tuple(types)


def problems(a: argparse.Namespace, world_size: int) -> list[str]:
    """One line for each context-parallel flag that cannot run (Megatron's rules, and what fmeg lacks yet)."""
    cp, tp, pp = a.context_parallel_size, a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    out = []
    if cp < 1:
        return [f"--context-parallel-size must be positive, got {cp}"]
    types = a.cp_comm_type
    if len(types) not in (1, a.num_layers):
        out.append(f"--cp-comm-type: {len(types)} values for --num-layers {a.num_layers}; give one, or one per layer")
    if "a2a+p2p" in types or a.hierarchical_context_parallel_sizes:
        out.append("--cp-comm-type a2a+p2p / --hierarchical-context-parallel-sizes: hierarchical context parallelism "
                   "is not in fmeg yet; use p2p, all_gather or a2a")
    if cp == 1:
        return out
    if world_size % (tp * pp * cp):
        out.append(f"world size {world_size} must be divisible by --tensor-model-parallel-size * "
                   f"--pipeline-model-parallel-size * --context-parallel-size = {tp} * {pp} * {cp}")
    chunk = 2 * cp * (tp if a.sequence_parallel else 1)
    if a.seq_length % chunk:
        out.append(f"--seq-length {a.seq_length} must be divisible by 2 x --context-parallel-size"
                   + (" x --tensor-model-parallel-size (sequence parallel)" if a.sequence_parallel else "")
                   + f" = {chunk}")
    if "a2a" in types:
        heads = a.num_attention_heads
        groups = a.num_query_groups if a.group_query_attention and a.num_query_groups else heads
        if (heads // tp) % cp or (groups // tp) % cp:
            out.append(f"--cp-comm-type a2a splits heads over cp: {heads} attention heads and {groups} query groups "
                       f"per tensor-parallel rank ({heads // tp}, {groups // tp}) must be divisible by "
                       f"--context-parallel-size {cp}")
    if a.compile:
        out.append("--context-parallel-size with --compile: context-parallel attention runs eagerly (its ring passes "
                   "blocks point to point); drop --compile")
    return out
