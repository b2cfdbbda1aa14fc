"""A pipeline stage as a chain of segments, so that backward hands over gradients piece by piece.

    Segment(fn, keys=("layers.2",))     # fn(sub, x, batch) -> the next segment's x

sub is {key: the stage params' subtree at that dotted path} for each key, or the whole stage params
when keys is None. The segments of a stage differentiate disjoint parts of its params, together all
of them; the first segment of stage 0 gets x = None, and the last one's output is the stage's
output. The executor runs one torch.func.vjp per segment, so the gradients of the last segments (the
first ones backward finishes) are final while earlier segments are still differentiating:
data-parallel reduction can start on them. A plain function (params, x, batch) is a stage of one
segment.

Activation recomputation: consecutive segments with the same `recompute` unit number form one unit
whose forward keeps only its input; backward runs the unit's forward again (keeping its vjps) and
then goes back through it. recompute_units gives Megatron's full-granularity methods.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from fmeg import tree


@dataclass(frozen=True)
class Segment:
    fn: Callable[[Any, Any, dict], Any]
    keys: tuple[str, ...] | None = None
    # the recompute unit this segment belongs to; None: activations kept
    recompute: int | None = None


def recompute_units(num_layers: int, method: str | None, count: int | None) -> list[int | None]:
    """For each of a stage's num_layers layers, its recompute unit (None: not recomputed), as
    Megatron's --recompute-method: "uniform" recomputes every chunk of `count` layers from its
    input; "block" recomputes each of the stage's first `count` layers from its own input; None
    recomputes nothing."""
    if method is None:
        return [None] * num_layers
    if method == "uniform":
        return [i // count for i in range(num_layers)]
    if method == "block":
        return [i if i < count else None for i in range(num_layers)]
    raise ValueError(f"recompute method {method!r}: expected 'uniform' or 'block'")


def units(segments: list[Segment]) -> list[list[Segment]]:
    """The segments grouped: each kept segment alone, each recompute unit's consecutive segments
    together."""
    out: list[list[Segment]] = []
    for segment in segments:
        if out and segment.recompute is not None and out[-1][-1].recompute == segment.recompute:
            out[-1].append(segment)
        else:
            out.append([segment])
    return out


def as_segments(stage: Callable | list[Segment]) -> list[Segment]:
    return list(stage) if isinstance(stage, (list, tuple)) else [Segment(stage)]


def subtree(params: Any, path: str) -> Any:
    node = params
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
    return node


def take(segment: Segment, params: Any) -> Any:
    """The part of the stage params this segment differentiates (paths inside it are stage
    paths)."""
    return params if segment.keys is None else {key: subtree(params, key) for key in segment.keys}


def compose(
    stage: Callable | list[Segment], use: Callable | None = None, index: int = 0
) -> Callable[[Any, Any, dict], Any]:
    """The stage as one function (params, x, batch) -> output, for forward-only use; with use, each
    segment runs inside use(index, its keys) (where sharded weights are gathered:
    fmeg.parallel.sharded_params)."""
    segments = as_segments(stage)

    def run(params: Any, x: Any, batch: dict) -> Any:
        for segment in segments:
            with use(index, segment.keys) if use else contextlib.nullcontext():
                x = segment.fn(take(segment, params), x, batch)
        return x

    return run


# (segment keys, params structure) pairs found covered
_covered: set[tuple] = set()


def check_cover(segments: list[Segment], params: Any, stage: int) -> None:
    """Every stage parameter is differentiated by exactly one segment. Which leaves a segment takes
    depends only on its keys and the params' structure, so each (keys, structure) pair is checked
    once (this runs every iteration) by leaf identity; paths are built only to name what is
    wrong."""
    leaves, spec = tree.tree_flatten(params)
    key = (tuple(segment.keys for segment in segments), spec)
    if key in _covered:
        return
    seen = [id(leaf) for segment in segments for leaf in tree.tree_leaves(take(segment, params))]
    if len(seen) == len(leaves) and set(seen) == {id(leaf) for leaf in leaves}:
        _covered.add(key)
        return
    paths: list[str] = []
    for segment in segments:
        paths += [path for path, _ in tree.items(take(segment, params))]
    want = [path for path, _ in tree.items(params)]
    if sorted(paths) != sorted(want):
        missing, twice = set(want) - set(paths), {p for p in paths if paths.count(p) > 1}
        raise ValueError(
            f"segments of stage {stage}: parameters missing {sorted(missing)[:3]}, differentiated "
            f"twice {sorted(twice)[:3]}"
        )
