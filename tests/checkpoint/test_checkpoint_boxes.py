"""The box algebra checkpoints are made of, against plain index arithmetic: a flat range of a block
is a few contiguous boxes covering exactly its elements; a stored box's cells partition it, and a
query finds exactly the cells it overlaps; cells are cut where finer layouts cut."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg.checkpoint.boxes import Box, Grid, cell_steps, flat_boxes

shapes = st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple)


@given(shapes, st.data())
def test_a_flat_range_is_a_few_contiguous_boxes_covering_exactly_its_elements(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    index = torch.arange(n).reshape(shape)
    boxes = flat_boxes(shape, start, stop)
    assert len(boxes) <= max(2 * len(shape) - 1, 1)
    covered = []
    for box, flat in boxes:
        values = index[box.within(Box((0,) * len(shape), shape))].reshape(-1)
        # contiguous, starting where it says
        assert values.tolist() == list(range(flat, flat + box.numel))
        covered += values.tolist()
    assert covered == list(range(start, stop))


@given(shapes, st.data())
def test_cells_partition_a_box_and_a_query_finds_exactly_the_cells_it_overlaps(shape, data):
    offset = tuple(data.draw(st.integers(0, 5)) for _ in shape)
    box = Box(offset, shape)
    steps = tuple(tuple(data.draw(st.lists(st.integers(1, 4), max_size=2))) for _ in shape)
    grid = Grid(box, steps)
    seen = torch.zeros(shape, dtype=torch.int64)
    for i in range(len(grid)):
        cell = grid.cell(i)
        assert cell.intersect(box) == cell
        seen[cell.within(box)] += 1
    assert bool((seen == 1).all())
    q_off = tuple(data.draw(st.integers(o, o + s - 1)) for o, s in zip(offset, shape))
    q = Box(
        q_off, tuple(data.draw(st.integers(1, o + s - a)) for a, o, s in zip(q_off, offset, shape))
    )
    assert grid.overlapping(q) == [
        i for i in range(len(grid)) if grid.cell(i).intersect(q) is not None
    ]


def test_cells_are_cut_for_finer_layouts_and_bounded_in_size():
    """A [4 experts, 768, 384] bf16 block: one cell per expert (any ep up to 4x finer reads whole
    cells), the tensor-parallel dimension in 2, 4 or 8 equal parts, and no cell over the limit."""
    steps = cell_steps((4, 768, 384), 2, split_dims=(0, 1), max_cell=300_000)
    grid = Grid(Box((0, 0, 0), (4, 768, 384)), steps)
    assert steps[0] == (1,) and 768 // steps[1][0] in (2, 4, 8)
    assert all(grid.cell(i).numel * 2 <= 300_000 for i in range(len(grid)))
    assert cell_steps((16,), 4) == ((),)  # small tensors stay whole
