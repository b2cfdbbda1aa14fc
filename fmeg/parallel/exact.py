"""Sums whose bits do not depend on how their operands are split over ranks or in what order they
are added: the building block of --deterministic-mode's reductions (bitwise across layouts).

    fixed_point_sum(x, dim, group)    x summed over dim and over the group's ranks
    fixed_point_total(xs, group)      every element of every tensor in xs summed over the group
    acc = ExactAccumulator(numel)     a flat sum built a contribution at a time (gradients, one
    acc.add_(start, x)                microbatch after another), then summed over groups:
    acc.sum_over(group); acc.value()  the same bits for any split of the contributions
    acc.scatter_over(group, units)    the sum's chunks a rank owns (sharded gradients, FSDP)

A float sum rounds after every addition, so its bits follow the order of the additions, and a
layout that splits the operands over ranks changes that order. Here every operand is rounded once
to a fixed point whose scale all ranks agree on, the integers are summed exactly (int64 addition
is associative), and the total is rounded once back. The scale is set by the largest magnitude in
the whole sum (a maximum is exact, so it too is the same for any split) and the count of summed
elements (so no partial sum can overflow): each operand keeps 62 - ceil(log2 count) bits below
the largest one's leading bit, about 2^-50 of it for a million operands, finer than a float32
sum's own rounding. The result is the same tensor for any split of the summed elements over the
group and any order within a rank; it is not the float sum's bits (the default mode keeps those).

group may also be a tuple of groups (None entries skipped): the sum over their product, as exact
as over one.

Sharding contract: x is this rank's part of the summed elements (any part, even none: an empty dim);
the result is replicated, the same on every rank of group (None: one rank). Collectives: two
all-reduces of the result's shape (max of the magnitudes, then the int64 sum) and one of a scalar
count. Not differentiable: it serves sums taken outside autograd (gradient reductions, norms,
reported losses). A non-finite operand makes the result the float sum's inf or nan.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

_BITS = 62


def fixed_point_sum(
    x: torch.Tensor, dim: int | None = None, group: Any = None, count: int | None = None
) -> torch.Tensor:
    """The sum of x over dim (every element where None) and over the group, in x's dtype. count:
    a bound on the number of summed elements that sets the scale instead of their count over the
    group (so that zero operands a layout adds, vocabulary padding, change no bit; no collective
    and no host sync for it)."""
    x64 = x.detach().to(torch.float64)
    if dim is None:
        x64, dim = x64.reshape(-1), 0
    # the summed dim first: [count, *kept]
    x64 = x64.movedim(dim, 0)
    magnitude = x64.abs().amax(0) if x64.shape[0] else x64.new_zeros(x64.shape[1:])
    groups = _groups(group)
    if count is None:
        held = torch.tensor(x64.shape[0], dtype=torch.int64, device=x.device)
        count = int(_over(groups, held).item())
    magnitude = _over(groups, magnitude, "max")
    shift = _shift(magnitude, count)
    total = _over(groups, torch.ldexp(x64, shift).round().to(torch.int64).sum(0))
    out = torch.ldexp(total.to(torch.float64), -shift).to(x.dtype)
    bad = ~torch.isfinite(magnitude)
    if bool(bad.any()):
        out = torch.where(bad, _over(groups, x64.sum(0)).to(x.dtype), out)
    return out


def _groups(group: Any) -> tuple:
    return tuple(g for g in (group if isinstance(group, tuple) else (group,)) if g is not None)


def _over(groups: tuple, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """x reduced over each group in turn: over their product (sums of integers and maxima are
    exact, so the order does not matter)."""
    for g in groups:
        x = g.all_reduce(x, op)
    return x


def fixed_point_total(xs: Sequence[torch.Tensor], group: Any = None) -> torch.Tensor:
    """Every element of every tensor in xs summed over the group (a float64 scalar): the same bits
    for any split of the elements over the tensors, the ranks and their order, and for any number
    of zero elements (vocabulary padding): each element's digits at fixed positions below the
    largest magnitude's leading bit (_TOTAL_DIGITS digits of _TOTAL_BITS bits, truncated) are
    summed as integers, so no count sets the scale. One all-reduce of the maximum, one of the
    digits' sums."""
    flat = [x.detach().to(torch.float64).reshape(-1) for x in xs]
    joined = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    groups = _groups(group)
    peak = _over(groups, joined.abs().amax() if joined.numel() else joined.new_zeros(()), "max")
    if not bool(torch.isfinite(peak)):
        return _over(groups, joined.sum())
    top = int(torch.frexp(peak).exponent)
    digits, rest = [], joined
    for i in range(_TOTAL_DIGITS):
        scale = top - _TOTAL_BITS * (i + 1)
        digit = torch.trunc(torch.ldexp(rest, torch.tensor(-scale)))
        digits.append(digit.to(torch.int64).sum())
        rest = rest - torch.ldexp(digit, torch.tensor(scale))
    sums = _over(groups, torch.stack(digits))
    total = torch.zeros((), dtype=torch.float64, device=joined.device)
    for i in range(_TOTAL_DIGITS):
        total = total + torch.ldexp(
            sums[i].to(torch.float64), torch.tensor(top - _TOTAL_BITS * (i + 1))
        )
    return total


# fixed_point_total's digits: 90 bits below the largest magnitude, and room in an int64 for the
# digits of 2^33 elements
_TOTAL_BITS, _TOTAL_DIGITS = 30, 3


def _shift(magnitude: torch.Tensor, count: int) -> torch.Tensor:
    """The power of two that puts the largest magnitude just under 2^(62 - ceil(log2 count))."""
    headroom = max(1, count - 1).bit_length()
    finite = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    # frexp's exponent e: magnitude < 2^e (0 for a zero magnitude)
    exponent = torch.frexp(finite).exponent.to(torch.int64)
    return (_BITS - headroom) - exponent


# An accumulator's bins: bin j holds, as an int64, the sum of every contribution's base-2^32 digit
# at 2^(32 j + _LOW), the digits cut by truncation toward zero. _BINS bins are kept below the top
# one (the bin of the largest magnitude seen): 96 bits, so what is dropped is under 2^-70 of the
# largest contribution; a bin's int64 takes 2^31 contributions before it could overflow.
_BIN_BITS, _BINS, _LOW = 32, 3, -160


class ExactAccumulator:
    """A flat float sum accumulated a contribution at a time (each leaf's gradient, microbatch
    after microbatch) whose result is the same bits in any order and for any split of the
    contributions over ranks: every contribution is cut into digits at fixed bit positions (exact)
    and the digits are summed as integers (exact); the digits that are dropped are those below the
    window of the largest magnitude of the whole sum, which no order changes.

    Sharding contract: each rank adds its own contributions; sum_over(group) leaves on every rank
    of group the sum over the group (one all-reduce of a scalar, the top bin's maximum, and one of
    the int64 bins: 3 x 8 bytes an element); value() is then replicated. A non-finite contribution
    on any rank makes every element of value() nan (the step's overflow check skips it)."""

    def __init__(self, numel: int, device: Any = None):
        self.bins = torch.zeros(_BINS, numel, dtype=torch.int64, device=device)
        self.reset()

    def reset(self) -> "ExactAccumulator":
        self.bins.zero_()
        self.top: int | None = None
        self.non_finite = False
        return self

    def add_(self, start: int, x: torch.Tensor) -> None:
        """Add x (flattened) into elements [start, start + x.numel())."""
        x64 = x.detach().reshape(-1).to(torch.float64)
        peak = x64.abs().max().item() if x64.numel() else 0.0
        if not math.isfinite(peak):
            self.non_finite = True
            return
        if peak == 0.0:
            return
        self._raise_top(_bin_of(peak))
        bins = self.bins[:, start : start + x64.numel()]
        rest = x64
        for i in range(_BINS):
            base = (self.top - i) * _BIN_BITS + _LOW
            # scaling by a power of two and truncating are exact in float64 for float32 input
            digit = torch.trunc(rest * 2.0**-base)
            bins[i] += digit.to(torch.int64)
            rest = rest - digit * 2.0**base

    def sum_over(self, group: Any) -> None:
        """Every rank of group (or of each group of a tuple, in turn) holds the sum over it."""
        for g in _groups(group):
            self._agree(g)
            self.bins = g.all_reduce(self.bins)

    def scatter_over(self, group: Any, units: Sequence[tuple[int, int]]) -> "ExactAccumulator":
        """This rank's chunks of the sum over group (None: one rank), a new accumulator: each unit
        [a, b) of the flat sum cut into group.size chunks, the rank-th summed over the group (one
        reduce-scatter of the int64 bins a unit), the units' chunks concatenated in order."""
        out = ExactAccumulator(0, device=self.bins.device)
        if group is not None:
            self._agree(group)
        out.top, out.non_finite = self.top, self.non_finite
        pieces = [self.bins[:, a:b] for a, b in units]
        chunks = [p.clone() if group is None else group.reduce_scatter(p, 1) for p in pieces]
        out.bins = torch.cat(chunks, 1) if chunks else self.bins[:, :0]
        return out

    def _agree(self, g: Any) -> None:
        """The top bin and the non-finite flag made the group's (a scalar all-reduce)."""
        state = torch.tensor(
            [-(2**40) if self.top is None else self.top, int(self.non_finite)],
            dtype=torch.int64,
            device=self.bins.device,
        )
        top, non_finite = g.all_reduce(state, "max").tolist()
        self.non_finite = bool(non_finite)
        if top > -(2**40):
            self._raise_top(top)

    def value(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The sum, rounded once to dtype (each bin is exact in float64; their sum rounds once)."""
        out = torch.zeros(self.bins.shape[1], dtype=torch.float64, device=self.bins.device)
        if self.non_finite:
            return out.fill_(math.nan).to(dtype)
        if self.top is not None:
            for i in range(_BINS):
                out += self.bins[i].to(torch.float64) * 2.0 ** ((self.top - i) * _BIN_BITS + _LOW)
        return out.to(dtype)

    def _raise_top(self, top: int) -> None:
        """Make `top` the top bin (if above the current one): the bins that fall out of the window
        are dropped whole, as they would be had the larger contribution come first."""
        if self.top is not None and top <= self.top:
            return
        shift = _BINS if self.top is None else min(top - self.top, _BINS)
        if shift < _BINS:
            self.bins[shift:] = self.bins[: _BINS - shift].clone()
        self.bins[:shift] = 0
        self.top = top


def _bin_of(peak: float) -> int:
    """The bin holding the leading bit of a positive float."""
    _, exponent = math.frexp(peak)
    return (exponent - 1 - _LOW) // _BIN_BITS
