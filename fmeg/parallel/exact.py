"""Sums whose bits do not depend on how their operands are split over ranks or in what order they
are added: the building block of --deterministic-mode's reductions (bitwise across layouts).

    fixed_point_sum(x, dim, group)    x summed over dim and over the group's ranks
    fixed_point_total(xs, group)      every element of every tensor in xs summed over the group

A float sum rounds after every addition, so its bits follow the order of the additions, and a
layout that splits the operands over ranks changes that order. Here every operand is rounded once
to a fixed point whose scale all ranks agree on, the integers are summed exactly (int64 addition
is associative), and the total is rounded once back. The scale is set by the largest magnitude in
the whole sum (a maximum is exact, so it too is the same for any split) and the count of summed
elements (so no partial sum can overflow): each operand keeps 62 - ceil(log2 count) bits below
the largest one's leading bit, about 2^-50 of it for a million operands, finer than a float32
sum's own rounding. The result is the same tensor for any split of the summed elements over the
group and any order within a rank; it is not the float sum's bits (the default mode keeps those).

Sharding contract: x is this rank's part of the summed elements (any part, even none: an empty dim);
the result is replicated, the same on every rank of group (None: one rank). Collectives: two
all-reduces of the result's shape (max of the magnitudes, then the int64 sum) and one of a scalar
count. Not differentiable: it serves sums taken outside autograd (gradient reductions, norms,
reported losses). A non-finite operand makes the result the float sum's inf or nan.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

_BITS = 62


def fixed_point_sum(x: torch.Tensor, dim: int | None = None, group: Any = None) -> torch.Tensor:
    """The sum of x over dim (every element where None) and over the group, in x's dtype."""
    x64 = x.detach().to(torch.float64)
    if dim is None:
        x64, dim = x64.reshape(-1), 0
    # the summed dim first: [count, *kept]
    x64 = x64.movedim(dim, 0)
    count = torch.tensor(x64.shape[0], dtype=torch.int64)
    magnitude = (
        x64.abs().amax(0) if x64.shape[0] else torch.zeros(x64.shape[1:], dtype=torch.float64)
    )
    if group is not None:
        count, magnitude = group.all_reduce(count), group.all_reduce(magnitude, "max")
    shift = _shift(magnitude, count)
    total = torch.ldexp(x64, shift).round().to(torch.int64).sum(0)
    total = group.all_reduce(total) if group is not None else total
    out = torch.ldexp(total.to(torch.float64), -shift).to(x.dtype)
    bad = ~torch.isfinite(magnitude)
    if bool(bad.any()):
        plain = x64.sum(0)
        plain = group.all_reduce(plain) if group is not None else plain
        out = torch.where(bad, plain.to(x.dtype), out)
    return out


def fixed_point_total(xs: Sequence[torch.Tensor], group: Any = None) -> torch.Tensor:
    """Every element of every tensor in xs summed over the group (a float64 scalar): the same bits
    for any split of the elements over the tensors, the ranks and their order."""
    flat = [x.detach().to(torch.float64).reshape(-1) for x in xs]
    joined = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    return fixed_point_sum(joined, 0, group)


def _shift(magnitude: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The power of two that puts the largest magnitude just under 2^(62 - ceil(log2 count))."""
    headroom = max(1, int(count.item()) - 1).bit_length()
    finite = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    # frexp's exponent e: magnitude < 2^e (0 for a zero magnitude)
    exponent = torch.frexp(finite).exponent.to(torch.int64)
    return (_BITS - headroom) - exponent
