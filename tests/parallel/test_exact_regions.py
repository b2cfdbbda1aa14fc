"""--deterministic-mode's tensor-parallel regions (fmeg.parallel.exact_regions): a column- then
row-parallel MLP at tp 2 and 4 gives one rank's output and gradients bit for bit (==, the
weights' slices joined), within float rounding of the plain float computation; a parameter
applied a token at a time gets one rank's gradient for any split of the tokens; the regions'
jvp is the forward of the tangent, their vmap the stack of the rows' results."""

import torch
from hypothesis import given, settings, strategies as st
from torch.func import jvp, vmap

from harness import exact_sums as P
from harness.parallel import run
from fmeg.parallel.exact_regions import (
    column_linear,
    exact_copy,
    exact_reduce,
    pieces_held,
    row_linear,
)


@st.composite
def mlps(draw):
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    tokens, k = draw(st.integers(1, 12)), draw(st.sampled_from([4, 8, 12]))
    lead = draw(st.sampled_from([(), (2,)]))
    rows = 8 * draw(st.integers(1, 3))
    hidden = rows * (lead[0] if lead else 1)
    x = torch.randn(2, tokens, k, generator=g)
    w1 = torch.randn(*lead, rows, k, generator=g) / k**0.5
    b1 = torch.randn(*lead, rows, generator=g)
    w2 = torch.randn(k, *lead, rows, generator=g) / hidden**0.5
    return x, w1, b1, w2


def _joined(results):
    """One rank's (y, gx, gw1, gb1, gw2) from every rank's slices."""
    y, gx = results[0][0], results[0][1]
    gw1 = torch.cat([r[2] for r in results], -2)
    gb1 = torch.cat([r[3] for r in results], -1)
    return y, gx, gw1, gb1, torch.cat([r[4] for r in results], -1)


@settings(max_examples=20, deadline=None)
@given(mlps(), st.sampled_from([2, 4]))
def test_a_tensor_parallel_mlp_gives_one_ranks_bits(case, world):
    x, w1, b1, w2 = case
    if w1.shape[-2] % world:
        return
    (want,) = run("threads", 1, P.exact_mlp, x, w1, b1, w2)
    got = _joined(run("threads", world, P.exact_mlp, x, w1, b1, w2))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    plain = torch.tanh(x @ w1.flatten(0, -2).T + b1.flatten()) @ w2.flatten(1).T
    assert torch.allclose(want[0], plain, rtol=1e-5, atol=1e-5)


def test_a_split_over_gloo_processes_gives_one_ranks_bits():
    g = torch.Generator().manual_seed(3)
    x, w1 = torch.randn(2, 5, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    b1, w2 = torch.randn(2, 16, generator=g), torch.randn(8, 2, 16, generator=g)
    (want,) = run("threads", 1, P.exact_mlp, x, w1, b1, w2)
    for a, b in zip(_joined(run("gloo", 2, P.exact_mlp, x, w1, b1, w2)), want):
        assert torch.equal(a, b)


@given(st.integers(0, 2**16), st.sampled_from([2, 4]))
def test_a_parameter_applied_a_token_at_a_time_gets_one_ranks_gradient(seed, world):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 3, 6, generator=g) * torch.exp2(torch.randint(-12, 12, (8, 3, 6)))
    w = torch.randn(6, generator=g)
    (one,) = run("threads", 1, P.token_scaled, x, w)
    got = run("threads", world, P.token_scaled, x, w)
    assert torch.equal(torch.cat([r[0] for r in got]), one[0])
    assert all(torch.equal(r[1], one[1]) for r in got)
    assert torch.allclose(one[1], (2 * x * x * w).sum((0, 1)), rtol=1e-5)


def test_the_pieces_are_the_whole_dimensions_not_the_layouts():
    # 8 pieces of any dimension 8 divides, whole pieces on each of 1, 2, 4 or 8 ranks
    assert [pieces_held(64 // t, t) for t in (1, 2, 4, 8)] == [8, 4, 2, 1]
    # fewer where the dimension has fewer: 12 rows in 4 pieces, 2 a rank at tp 2
    assert pieces_held(12, 1) == 4 and pieces_held(6, 2) == 2
    # vocabulary rows in pieces of 128: 384 padded rows at tp 1, 512 at tp 2
    assert pieces_held(384, 1, 128) == 3 and pieces_held(256, 2, 128) == 2


def test_jvp_is_the_forward_of_the_tangent_and_vmap_the_rows_results():
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    w = torch.randn(16, 8, generator=g)

    def f(x):
        return row_linear(column_linear(x, w, None, 4, None), w.T.contiguous(), 2, None)

    _, tangent = jvp(f, (x,), (t,))
    assert torch.equal(tangent, f(t))
    batched = vmap(f)(torch.stack([x, t]))
    assert torch.allclose(batched, torch.stack([f(x), f(t)]), rtol=1e-6, atol=1e-6)
    pieces = torch.randn(4, 3, generator=g)
    assert torch.equal(
        vmap(lambda p: exact_reduce(p, None), in_dims=1)(pieces), exact_reduce(pieces, None)
    )
    assert torch.equal(vmap(lambda v: exact_copy(v, 2, None))(x), x[:, None].expand(3, 2, 8))
