"""Boxes: rectangular blocks of a global tensor, the one shape of data a checkpoint stores and
reads.

    box = Box((48, 0), (48, 32))                     # rows 48..96 of a [96, 32] tensor
    box.intersect(Box((64, 0), (64, 32)))            # Box((64, 0), (32, 32))
    # a row-major range of a block as boxes, each contiguous
    flat_boxes((6, 4), 5, 17)
    cells(box, steps)                                # the cells a stored box is cut into

A tensor-parallel shard is a box; a distributed-optimizer slice of a flattened block is a few boxes
(flat_boxes); a stored box is cut into cells, each written as one tensor with its own checksum, so
that a reader reads whole cells only where its boxes and the stored ones overlap.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

# a cell: the most a reader reads beyond what it needs, at each edge of its boxes
MAX_CELL_BYTES = 1 << 20


def cell_bytes_for(share: int) -> int:
    """The cell size for ranks holding `share` bytes each: small next to a share (a reader's extra
    bytes at the edges of its boxes, a few cells, stay within a few percent of it), from 64 KiB to 4
    MiB."""
    return min(max(share // 256, 1 << 16), 1 << 22)


# a split dimension is cut for finer layouts only where the parts stay this large
MIN_SPLIT_BYTES = 1 << 17
# a block cut along its split dimension reads whole cells at up to 8x as many parts
SPLIT_PARTS = 8


@dataclass(frozen=True)
class Box:
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def within(self, outer: "Box") -> tuple[slice, ...]:
        """The index of this box inside a tensor holding `outer`."""
        return tuple(
            slice(a - o, a - o + s) for a, o, s in zip(self.offset, outer.offset, self.shape)
        )

    def key(self) -> str:
        """'48:96,0:32': as the box's cell is named in a file."""
        return ",".join(f"{o}:{o + s}" for o, s in zip(self.offset, self.shape))


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    """The row-major range [start, stop) of a block of `shape` as (box in the block, flat index of
    its first element): at most 2 x ndim - 1 boxes, each contiguous in the block's flat order."""
    if start >= stop:
        return []
    if not shape:
        return [(Box((), ()), 0)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)

    def row(r: int, a: int, b: int) -> list[tuple[Box, int]]:
        return [
            (Box((r, *box.offset), (1, *box.shape)), r * inner + flat)
            for box, flat in flat_boxes(shape[1:], a, b)
        ]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append((Box((r0, *[0] * (len(shape) - 1)), (r1 - r0, *shape[1:])), r0 * inner))
    if c1:
        out += row(r1, 0, c1)
    return out


def cell_steps(
    shape: tuple[int, ...],
    itemsize: int,
    split_dims: tuple[int, ...] = (),
    max_cell: int = MAX_CELL_BYTES,
) -> tuple[tuple[int, ...], ...]:
    """Where the cells of a stored block of `shape` (one rank's whole block of a leaf: every rank's
    pieces of the leaf are cut alike) are cut, per dimension, as steps whose multiples (in global
    coordinates) are cut points: along each of split_dims (the dimensions expert and tensor
    parallelism split) into up to SPLIT_PARTS parts, so that a layout splitting it more finely reads
    whole cells; then the outer dimensions in blocks of at most max_cell bytes."""
    steps: list[list[int]] = [[] for _ in shape]
    cell = list(shape)
    for d in (d % len(shape) for d in split_dims if shape):
        parts = next(
            k
            for k in (SPLIT_PARTS, 4, 2, 1)
            if cell[d] % k == 0 and math.prod(cell) * itemsize // k >= MIN_SPLIT_BYTES or k == 1
        )
        if parts > 1:
            steps[d].append(cell[d] // parts)
            cell[d] //= parts
    for d in range(len(shape)):
        if math.prod(cell[d:]) * itemsize <= max_cell:
            break
        inner = math.prod(cell[d + 1 :]) * itemsize
        block = max(1, max_cell // inner)
        # prefer a divisor of the split's part, so that no sliver cells appear
        if steps[d] and block < cell[d]:
            divisor = max(b for b in range(1, block + 1) if cell[d] % b == 0)
            block = divisor if divisor * 2 > block else block
        if block < cell[d]:
            steps[d].append(block)
            cell[d] = block
    return tuple(tuple(s) for s in steps)


def _cuts(lo: int, hi: int, steps: tuple[int, ...]) -> list[int]:
    points = {lo, hi}
    for step in steps:
        points.update(range(-(-lo // step) * step, hi, step))
    return sorted(p for p in points if lo <= p <= hi)


class Grid:
    """The cells a stored box is cut into (cut points at the multiples of each dimension's steps),
    numbered in row-major order of the grid."""

    def __init__(self, box: Box, steps: tuple[tuple[int, ...], ...]):
        self.box = box
        self.cuts = [_cuts(o, o + s, st) for o, s, st in zip(box.offset, box.shape, steps)]
        self.counts = [len(c) - 1 for c in self.cuts]

    def __len__(self) -> int:
        return math.prod(self.counts)

    def cell(self, index: int) -> Box:
        pos = []
        for count in reversed(self.counts):
            index, i = divmod(index, count)
            pos.append(i)
        pos.reverse()
        return Box(
            tuple(c[i] for c, i in zip(self.cuts, pos)),
            tuple(c[i + 1] - c[i] for c, i in zip(self.cuts, pos)),
        )

    def overlapping(self, box: Box) -> list[int]:
        """The indices of the cells that overlap box, in order."""
        ranges = []
        for cuts, o, s in zip(self.cuts, box.offset, box.shape):
            first = max(bisect.bisect_right(cuts, o) - 1, 0)
            last = min(bisect.bisect_left(cuts, o + s), len(cuts) - 1)
            ranges.append(range(first, last))
        out = []
        for pos in itertools.product(*ranges):
            index = 0
            for i, count in zip(pos, self.counts):
                index = index * count + i
            out.append(index)
        return out
