"""The experts' FP8 grouped GEMMs (fmeg.fp8.grouped) against a plain definition written here: each
(expert, source microbatch) group of rows quantized with its own tensor-wise scale, each expert's
weight with its own, the product of the dequantized values in fp64; and the property that makes
expert parallelism layout-invariant: rows of two microbatches in one call give what each
microbatch's own call gives (forward, input and weight gradients)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.fp8 import E4M3, E5M2, Fp8Experts, Fp8Recipe, fp8_grouped_linear
from fmeg.fp8.delayed import DelayedState


def dequantized(t: torch.Tensor, dtype) -> torch.Tensor:
    """t's FP8 values with one scale, max / amax (fp64, then fp32), as fp64."""
    top = torch.finfo(dtype).max
    scale = (top / t.abs().max().double().clamp(min=1e-12)).float()
    return ((t * scale).clamp(-top, top).to(dtype).float() / scale).double()


def definition(x, w, g, expert, source, recipe):
    """(y, dx, dw): per (expert, source) group of rows and per expert weight."""
    gdt = recipe.grad_dtype
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx, dw = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(w.shape, dtype=torch.float64)
    for e in range(w.shape[0]):
        we = dequantized(w[e], E4M3)
        for s in source.unique().tolist():
            mine = (expert == e) & (source == s)
            if mine.any():
                xe, ge = dequantized(x[mine], E4M3), dequantized(g[mine], gdt)
                y[mine], dx[mine] = xe @ we.T, ge @ we
                dw[e] += ge.T @ xe
    return y, dx, dw


def run(x, w, counts, expert, source, g, spec):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_linear(x, w, counts, expert, source, spec)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def problem(seed, experts, rows, k, n, log_range, sources):
    gen = torch.Generator().manual_seed(seed)
    spread = lambda *s: (
        torch.randn(*s, generator=gen)
        * 10.0
        ** (  # noqa: E731
            torch.rand(*s, generator=gen) * log_range - log_range / 2
        )
    )
    expert = torch.randint(0, experts, (rows,), generator=gen).sort().values
    source = torch.randint(0, sources, (rows,), generator=gen)
    counts = torch.bincount(expert, minlength=experts)
    return spread(rows, k), spread(experts, n, k), counts, expert, source, spread(rows, n)


def close(got, want, atol_scale=1e-5):
    top = (want.abs().max().item() if want.numel() else 0.0) or 1.0
    torch.testing.assert_close(got.double(), want, rtol=0, atol=atol_scale * top)


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 4),
    rows=st.integers(1, 40),
    k=st.sampled_from([4, 8, 12]),
    n=st.sampled_from([4, 8, 16]),
    log_range=st.sampled_from([0.0, 2.0, 6.0]),
    fmt=st.sampled_from(["hybrid", "e4m3"]),
    seed=st.integers(0, 2**16),
)
def test_each_group_of_rows_has_its_own_scale_as_the_definition_says(
    experts, rows, k, n, log_range, fmt, seed
):
    x, w, counts, expert, source, g = problem(seed, experts, rows, k, n, log_range, 3)
    spec = Fp8Experts(Fp8Recipe(fmt, "tensorwise"), sources=3)
    for got, want in zip(
        run(x, w, counts, expert, source, g, spec), definition(x, w, g, expert, source, spec.recipe)
    ):
        close(got, want)


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 4),
    rows=st.integers(2, 40),
    log_range=st.sampled_from([0.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_two_microbatches_in_one_call_give_each_microbatchs_own_numbers(
    experts, rows, log_range, seed
):
    """Expert parallelism brings an expert rows of several microbatches: each row's output and
    input gradient is what its own microbatch's call gives, and the weight gradient their sum."""
    x, w, counts, expert, source, g = problem(seed, experts, rows, 8, 8, log_range, 2)
    spec = Fp8Experts(Fp8Recipe("hybrid", "tensorwise"), sources=2)
    y, dx, dw = run(x, w, counts, expert, source, g, spec)
    one = Fp8Experts(Fp8Recipe("hybrid", "tensorwise"))
    dw_sum = torch.zeros_like(dw)
    for s in (0, 1):
        mine = source == s
        ys, dxs, dws = run(
            x[mine],
            w,
            torch.bincount(expert[mine], minlength=experts),
            expert[mine],
            source[mine] * 0,
            g[mine],
            one,
        )
        # the same FP8 numbers: apart only by fp32 accumulation over other row counts
        close(y[mine], ys.double(), 1e-6)
        close(dx[mine], dxs.double(), 1e-6)
        dw_sum += dws
    close(dw, dw_sum.double(), 1e-6)


def test_a_zero_expert_stays_zero_and_inf_or_nan_is_never_silent():
    x, w, counts, expert, source, g = problem(0, 2, 12, 8, 8, 0.0, 1)
    spec = Fp8Experts(Fp8Recipe("hybrid", "tensorwise"))
    zero = x.clone()
    zero[expert == 0] = 0.0
    y, dx, dw = run(zero, w, counts, expert, source, g, spec)
    assert (y[expert == 0] == 0).all() and y[expert == 1].abs().sum() > 0
    assert (dw[0] == 0).all() and dx.isfinite().all()
    for bad in (float("inf"), float("nan")):
        poisoned = x.clone()
        poisoned[0, 0] = bad
        y, _, _ = run(poisoned, w, counts, expert, source, g, spec)
        assert y[expert == expert[0]].isnan().any()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_delayed_scaling_reads_and_records_each_experts_row(fmt):
    """Each expert quantizes with its own row's scales and records its own amaxes there (the
    gradient's in one device's units: over grad_factor)."""
    x, w, counts, expert, source, g = problem(1, 3, 30, 8, 8, 2.0, 1)
    state = DelayedState(2, 4, grad_factor=2, num_experts=3)
    rows = tuple(state.expert_row(1, e, "fc2") for e in range(3))
    state.scale[list(rows)] = torch.tensor([[2.0, 4.0, 8.0], [1.0, 0.5, 2.0], [16.0, 8.0, 4.0]])
    recipe = Fp8Recipe(fmt, "delayed", history_len=4)
    y, dx, dw = run(x, w, counts, expert, source, g, Fp8Experts(recipe, delayed=(state, rows)))
    gdt = E5M2 if fmt == "hybrid" else E4M3
    for e, row in enumerate(rows):
        sx, sw, sg = state.scale[row].tolist()
        sg /= 2
        mine = expert == e
        deq = lambda t, s, d: (
            (t * s).clamp(-torch.finfo(d).max, torch.finfo(d).max).to(d).double() / s
        )  # noqa: E731
        xe, we, ge = deq(x[mine], sx, E4M3), deq(w[e], sw, E4M3), deq(g[mine], sg, gdt)
        close(y[mine], xe @ we.T)
        close(dx[mine], ge @ we)
        close(dw[e], ge.T @ xe)
        amaxes = state.history[0, row]
        want = [x[mine].abs().max(), w[e].abs().max(), g[mine].abs().max() / 2]
        torch.testing.assert_close(amaxes, torch.stack(want))
    assert (state.history[1:] == 0).all() and (state.history[0, : rows[0]] == 0).all()


def split_microbatch(mesh, x, w, expert, g):
    """This rank's half of one microbatch's rows (as context parallelism splits them), its
    experts' amaxes joined over the other half's holder."""
    mine = torch.arange(x.shape[0]) % 2 == mesh.rank
    spec = Fp8Experts(Fp8Recipe("hybrid", "tensorwise"), amax_groups=(mesh.group("dp"),))
    counts = torch.bincount(expert[mine], minlength=w.shape[0])
    return run(x[mine], w, counts, expert[mine], expert[mine] * 0, g[mine], spec)


def test_a_microbatch_split_over_ranks_quantizes_as_one_device():
    from fmeg.parallel.spmd import run_threads

    x, w, counts, expert, source, g = problem(2, 3, 40, 8, 8, 4.0, 1)
    y, dx, dw = run(x, w, counts, expert, source, g, Fp8Experts(Fp8Recipe("hybrid", "tensorwise")))
    halves = run_threads(2, split_microbatch, x, w, expert, g)
    for rank, (y_r, dx_r, _) in enumerate(halves):
        mine = torch.arange(x.shape[0]) % 2 == rank
        close(y_r, y[mine].double(), 1e-6)
        close(dx_r, dx[mine].double(), 1e-6)
    close(halves[0][2] + halves[1][2], dw.double(), 1e-6)


def one_ranks_experts(dispatcher: str, microbatch: int, sources: int):
    """(y, dx, dfc1, dfc2) of a model's two experts top-2 run here (ep 1) by the named token
    dispatcher, their grouped GEMMs tensor-wise FP8, this rank data-parallel rank `microbatch`
    of `sources`."""
    import torch.nn.functional as F

    from fmeg.models.expert_dispatch import allgather_experts, alltoall_experts
    from fmeg.ops.moe import route
    from fmeg.parallel.tensor import ExpertParallel

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 8, generator=gen).requires_grad_()
    fc1 = torch.randn(2, 12, 8, generator=gen).requires_grad_()
    fc2 = torch.randn(2, 8, 12, generator=gen).requires_grad_()
    probs, experts = route(torch.randn(2, 6, 2, generator=gen), topk=2)
    p = {"fc1": {"weight": fc1}, "fc2": {"weight": fc2}}
    ep = ExpertParallel(sources=(microbatch,), microbatch=microbatch, num_sources=sources)
    spec = Fp8Experts(Fp8Recipe("hybrid", "tensorwise"), sources=sources)

    def grouped(site, rows, w, counts, expert_of_row, source_of_row):
        return fp8_grouped_linear(rows, w, counts, expert_of_row, source_of_row, spec)

    if dispatcher == "alltoall":
        y = alltoall_experts(p, x, probs, experts, ep, F.gelu, grouped)
    else:
        y = allgather_experts(p, x, probs, experts, None, ep, (None, 0, 1), F.gelu, grouped)
    g = torch.randn(y.shape, generator=gen)
    return (y.detach(), *torch.autograd.grad(y, (x, fc1, fc2), g))


def test_one_ranks_alltoall_dispatcher_gives_its_fp8_experts_a_microbatch_per_token():
    """Issue 67: GPT-OSS's script with FP8 kept (pp 2, two experts top-2, alltoall) stopped in
    expert_mlp, handed one microbatch id for all of a rank's tokens where it takes one per token.
    At ep 1 every token is this rank's microbatch's: the alltoall dispatcher's FP8 experts give
    the allgather dispatcher's numbers (forward and every gradient), and a second data-parallel
    rank's (microbatch 1 of 2) are one rank's (microbatch 0 of 1), each group its own scale."""
    want = one_ranks_experts("allgather", 0, 1)
    for microbatch, sources in ((0, 1), (1, 2)):
        for dispatcher in ("alltoall", "allgather"):
            got = one_ranks_experts(dispatcher, microbatch, sources)
            for a, b in zip(got, want):
                assert torch.equal(a, b), (dispatcher, microbatch)


@pytest.mark.parametrize(
    "world, sizes, sources, joined",
    [
        (2, {"ep": 2}, [(0, 1), (0, 1)], False),
        (2, {"cp": 2}, [(0,), (0,)], True),
        (2, {"tp": 2}, [(0, 0), (0, 0)], False),
        (4, {"tp": 2, "ep": 2, "etp": 1}, [(0, 0), (0, 0), (1, 1), (1, 1)], False),
        (4, {"cp": 2, "ep": 2}, [(0, 0), (0, 0), (1, 1), (1, 1)], False),
        (4, {"tp": 2, "ep": 1, "etp": 1}, [(0,), (0,), (1,), (1,)], True),
    ],
)
def test_each_dispatch_members_microbatch_and_when_amaxes_join(world, sizes, sources, joined):
    """The experts' tokens move over tp x ep (tp's when the experts are not apart); ranks that
    split one microbatch (tp x cp) but send to different holders join their amaxes."""
    from types import SimpleNamespace

    from fmeg.parallel.mesh import Mesh
    from fmeg.training.stage_functions import _expert_sources

    cp, tp = sizes.get("cp", 1), sizes.get("tp", 1)
    layout = SimpleNamespace(
        experts_apart=sizes.get("ep", 1) > 1 or sizes.get("etp", tp) != tp, dp=world // (cp * tp)
    )
    for rank in range(world):
        mesh = Mesh.build(rank, world, lambda ranks: tuple(ranks), **sizes)
        got = _expert_sources(layout, mesh)
        assert got["sources"] == sources[rank] and got["num_sources"] == layout.dp
        assert (got["amax_group"] is not None) == joined


def block_dequantized(t: torch.Tensor, dtype, rows: int, cols: int) -> torch.Tensor:
    """t [R, C]'s FP8 values in rows x cols blocks, each scaled by 2^floor(log2(max / amax)), as
    fp64 (a loop over blocks: the definition)."""
    top, out = torch.finfo(dtype).max, torch.empty(t.shape, dtype=torch.float64)
    for r in range(0, t.shape[0], rows):
        for c in range(0, t.shape[1], cols):
            part = t[r : r + rows, c : c + cols].float()
            amax = part.abs().max().double().clamp(min=1e-12)
            scale = 2.0 ** torch.floor(torch.log2(top / amax)).float()
            q = (part * scale).clamp(-top, top).to(dtype).float() / scale
            out[r : r + rows, c : c + cols] = q.double()
    return out


def block_definition(x, w, g, expert, source, recipe):
    """(y, dx, dw) of a block recipe: rows in 1 x b blocks, the weight in 128 x 128 tiles
    (blockwise) or 1 x 32 blocks along each GEMM's reduction dimension (mxfp8), the weight
    gradient's operands in b-row blocks of each (expert, source) group."""
    b = {"blockwise": 128, "mxfp8": 32}[recipe.recipe]
    gdt = recipe.grad_dtype
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    dx, dw = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(w.shape, dtype=torch.float64)
    for e in range(w.shape[0]):
        tile = recipe.recipe == "blockwise"
        w_fwd = block_dequantized(w[e], E4M3, 128 if tile else 1, b)
        w_bwd = w_fwd if tile else block_dequantized(w[e].T, E4M3, 1, b).T
        mine = expert == e
        y[mine] = block_dequantized(x[mine], E4M3, 1, b) @ w_fwd.T
        dx[mine] = block_dequantized(g[mine], gdt, 1, b) @ w_bwd
        for s in source.unique().tolist():
            group = mine & (source == s)
            if group.any():
                gt = block_dequantized(g[group].T, gdt, 1, b)
                dw[e] += gt @ block_dequantized(x[group].T, E4M3, 1, b).T
    return y, dx, dw


@settings(max_examples=15, deadline=None)
@given(
    recipe=st.sampled_from(["blockwise", "mxfp8"]),
    experts=st.integers(1, 3),
    rows=st.integers(1, 80),
    k=st.sampled_from([32, 48, 160]),
    n=st.sampled_from([32, 64]),
    log_range=st.sampled_from([0.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_block_recipes_follow_their_definition_per_expert_and_source(
    recipe, experts, rows, k, n, log_range, seed
):
    x, w, counts, expert, source, g = problem(seed, experts, rows, k, n, log_range, 2)
    # rows of a source interleaved with the other's, as the all-gather dispatcher leaves them
    spec = Fp8Experts(Fp8Recipe("hybrid", recipe), sources=2)
    for got, want in zip(
        run(x, w, counts, expert, source, g, spec),
        block_definition(x, w, g, expert, source, spec.recipe),
    ):
        close(got, want)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 100),
    groups=st.integers(1, 4),
    block=st.sampled_from([4, 32]),
    fmt=st.sampled_from([E4M3, E5M2]),
    seed=st.integers(0, 2**16),
)
def test_weight_gradient_blocks_start_at_each_groups_first_row(rows, groups, block, fmt, seed):
    """Power-of-two scales move an element's FP8 value only where it is subnormal or saturated
    beside its block's largest, so the GEMMs above barely see where blocks start: here, over ten
    decades, each group's values are bitwise its own blocks' (in row order, the rows of groups
    interleaved)."""
    from fmeg.fp8.grouped import _token_blocks

    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, 6, generator=gen) * 10.0 ** (torch.rand(rows, 6, generator=gen) * 10 - 5)
    group = torch.randint(0, groups, (rows,), generator=gen)
    got = _token_blocks(t, group, block, fmt)
    for k in group.unique().tolist():
        mine = group == k
        want = block_dequantized(t[mine].T, fmt, 1, block).T
        assert torch.equal(got[mine].double(), want)


class SavedState:
    """A checkpoint holding a delayed-scaling state (has / shape / read, as fmeg.checkpoint's)."""

    path = "ckpt"

    def __init__(self, state: DelayedState):
        self.pieces = {"fp8/history": state.history.clone(), "fp8/scale": state.scale.clone()}

    def has(self, name):
        return name in self.pieces

    def shape(self, name):
        return tuple(self.pieces[name].shape)

    def read(self, requests):
        for r in requests:
            where = tuple(slice(a, b) for a, b in zip(r.box.offset, r.box.end))
            r.out.copy_(self.pieces[r.name][where])


def test_a_state_saved_before_the_experts_rows_keeps_its_layers_and_starts_the_experts_fresh():
    from types import SimpleNamespace

    from fmeg.checkpoint import CheckpointError
    from fmeg.training.fp8_state import read_fp8

    old = DelayedState(2, 3)
    old.history.uniform_(1, 2)
    old.scale.uniform_(3, 4)
    state = SimpleNamespace(fp8=DelayedState(2, 3, num_experts=4))
    read_fp8(SavedState(old), state)
    dense = old.scale.shape[0]
    assert torch.equal(state.fp8.history[:, :dense], old.history)
    assert torch.equal(state.fp8.scale[:dense], old.scale)
    assert (state.fp8.history[:, dense:] == 0).all() and (state.fp8.scale[dense:] == 1).all()
    with pytest.raises(CheckpointError, match="has 16 rows and this model's 28"):
        read_fp8(SavedState(DelayedState(2, 3, num_experts=1)), state)
