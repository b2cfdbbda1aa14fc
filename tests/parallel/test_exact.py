"""fixed_point_sum's bits do not depend on the split: any split of the summed elements over 2 or 4
ranks, in any order on each, gives one rank's result bit for bit, within 2^-40 of the exact sum
(relative to the summed magnitudes), and the float sum's inf or nan where an operand is not
finite."""

import math

import torch
from hypothesis import given, strategies as st

from harness import exact_sums as P
from harness.parallel import run
from fmeg.parallel.exact import fixed_point_sum, fixed_point_total


@st.composite
def split_sums(draw):
    world = draw(st.sampled_from([2, 4]))
    n = draw(st.integers(0, 60))
    cols = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    # magnitudes over 40 binades, signs mixed: where a float sum's order shows most
    x = torch.randn(n, cols, generator=g) * torch.exp2(
        torch.randint(-20, 20, (n, cols), generator=g)
    )
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
    cuts = [0, *cuts, n]
    order = [torch.randperm(cuts[r + 1] - cuts[r], generator=g) for r in range(world)]
    return world, x, cuts, order


@given(split_sums())
def test_any_split_over_thread_ranks_gives_one_ranks_bits(case):
    world, x, cuts, order = case
    want = fixed_point_sum(x, 0)
    for got in run("threads", world, P.sum_of_my_part, x, cuts, order):
        assert torch.equal(got, want)
    exact = x.double().sum(0)
    bound = x.double().abs().sum(0) * 2.0**-40 + want.abs().double() * 2.0**-23
    assert bool(((want.double() - exact).abs() <= bound).all())


def test_a_split_over_gloo_processes_gives_one_ranks_bits():
    x = torch.randn(37, 3) * torch.exp2(torch.arange(37.0)[:, None] - 18)
    order = [torch.randperm(30), torch.randperm(7)]
    for got in run("gloo", 2, P.sum_of_my_part, x, [0, 30, 37], order):
        assert torch.equal(got, fixed_point_sum(x, 0))


def test_the_float_sum_depends_on_the_order_where_the_fixed_point_does_not():
    x = torch.tensor([1.0, 2.0**-24, 2.0**-24, -1.0])
    assert x.sum() != x[[0, 3, 1, 2]].sum() or x[[1, 2, 0, 3]].sum() != x[[0, 1, 2, 3]].sum()
    assert torch.equal(fixed_point_sum(x), fixed_point_sum(x[[1, 2, 0, 3]]))
    assert fixed_point_sum(x).item() == 2.0**-23


@given(st.integers(0, 2**16), st.integers(1, 4))
def test_a_total_over_tensors_does_not_depend_on_how_they_are_cut(seed, world):
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(50, generator=g) * torch.exp2(torch.randint(-30, 30, (50,), generator=g))
    cuts = sorted(torch.randint(0, 51, (2 * world - 1,), generator=g).tolist())
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, 50])]
    tensors = [pieces[2 * r : 2 * r + 2] for r in range(world)]
    want = fixed_point_total([whole])
    for got in run("threads", world, P.total_of_my_tensors, tensors):
        assert torch.equal(got, want)
    bound = whole.double().abs().sum().item() * 2.0**-40
    assert abs(want.item() - whole.double().sum().item()) <= bound


def test_a_non_finite_operand_gives_the_float_sums_inf_or_nan():
    assert fixed_point_sum(torch.tensor([1.0, math.inf])).item() == math.inf
    assert math.isnan(fixed_point_sum(torch.tensor([math.inf, -math.inf])).item())
    got = fixed_point_sum(torch.tensor([[1.0, math.nan], [2.0, 3.0]]), 0)
    assert got[0].item() == 3.0 and math.isnan(got[1].item())


def test_an_empty_sum_is_zero_in_the_inputs_dtype():
    got = fixed_point_sum(torch.zeros(0, 3, dtype=torch.bfloat16), 0)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.zeros(3, dtype=torch.bfloat16))


@st.composite
def contributions(draw):
    """Contributions of a flat sum of 40 elements (each some leaf's range, as gradients arrive),
    over 60 binades, an owner rank and an order for each."""
    world = draw(st.sampled_from([1, 2, 4]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draw(st.integers(1, 12))):
        start = int(torch.randint(0, 40, (1,), generator=g))
        n = int(torch.randint(0, 41 - start, (1,), generator=g))
        x = torch.zeros(40)
        scale = torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
        x[start : start + n] = torch.randn(n, generator=g) * scale
        out.append((0, x))
    owner = torch.randint(0, world, (len(out),), generator=g).tolist()
    order = torch.randperm(len(out), generator=g).tolist()
    return world, out, owner, order


@given(contributions())
def test_an_accumulated_sum_does_not_depend_on_who_adds_what_or_when(case):
    world, parts, owner, order = case
    want = P.accumulate_my_contributions(None, parts, [0] * len(parts), range(len(parts)))
    for got in run("threads", world, P.accumulate_my_contributions, parts, owner, order):
        assert torch.equal(got, want)
    exact = sum(x.double() for _, x in parts)
    bound = sum(x.double().abs() for _, x in parts) * 2.0**-60 + exact.abs() * 2.0**-24
    assert bool(((want.double() - exact).abs() <= bound).all())


@given(contributions())
def test_a_scattered_sum_is_each_ranks_chunks_of_the_whole_sum(case):
    """The units' rank-th chunks of the sum (FSDP's owned gradient) are the whole sum's bits."""
    world, parts, owner, order = case
    want = P.accumulate_my_contributions(None, parts, [0] * len(parts), range(len(parts)))
    units = [(0, 8), (8, 40)]
    got = run("threads", world, P.scatter_my_contributions, parts, owner, order, units)
    for rank, chunks in enumerate(got):
        mine = [want[a:b].chunk(world)[rank] for a, b in units]
        assert torch.equal(chunks, torch.cat(mine))


def test_a_non_finite_contribution_on_any_rank_makes_the_sum_nan():
    parts = [(0, torch.ones(3)), (0, torch.tensor([1.0, math.inf, 0.0]))]
    for got in run("threads", 2, P.accumulate_my_contributions, parts, [0, 1], [0, 1]):
        assert bool(torch.isnan(got).all())
