"""fmeg's FP8 linear against oracles: TorchAO's Float8Linear in emulate mode (tensor-wise and
row-wise scaling) and a plain quantize -> dequantize -> matmul reference of each recipe written
here from the recipes' definitions (Transformer Engine's and DeepSeek-V3's block sizes, OCP MX's
power-of-two scales); what happens to zeros, inf and NaN; and, on ranks that are threads, that
tensor-parallel shards quantize with the one-device scales."""

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.fp8 import E4M3, E5M2, Fp8Gemms, Fp8Recipe, fp8_linear


MAX = {E4M3: 448.0, E5M2: 57344.0}


def reference_quantize(t, dtype, block=None, tile=None):
    """t [R, K] -> its dequantized FP8 values, from the recipe's definition: scale = max / amax
    (tensor-wise, fp64 then fp32), or per block / tile of the last dimension a power of two
    2^floor(log2(max / amax))."""
    t = t.float()
    if block is None and tile is None:
        scale = (MAX[dtype] / t.abs().max().double().clamp(min=1e-12)).float()
        return (t * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype).float() / scale
    out = torch.empty_like(t)
    rows, cols = t.shape
    rstep, cstep = (1, block) if tile is None else (tile, tile)
    for r in range(0, rows, rstep):
        for c in range(0, cols, cstep):
            part = t[r : r + rstep, c : c + cstep]
            amax = part.abs().max().double().clamp(min=1e-12)
            scale = 2.0 ** torch.floor(torch.log2(MAX[dtype] / amax)).float()
            q = (part * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype).float()
            out[r : r + rstep, c : c + cstep] = q / scale
    return out


def reference_linear(x, w, g, recipe):
    """(y, dx, dw) of the recipe by quantize -> dequantize -> matmul in fp64."""
    gd = E5M2 if recipe.format == "hybrid" else E4M3
    r = recipe.recipe
    blk = {"blockwise": 128, "mxfp8": 32}.get(r)
    act = lambda t, d: reference_quantize(t, d, block=blk)  # noqa: E731
    wt = (
        (lambda t: reference_quantize(t, E4M3, tile=128))
        if r == "blockwise"
        else (lambda t: reference_quantize(t, E4M3, block=blk))
    )
    if r == "tensorwise":
        qx, qw, qg = (reference_quantize(t, d).double() for t, d in ((x, E4M3), (w, E4M3), (g, gd)))
        return qx @ qw.T, qg @ qw, qg.T @ qx
    y = act(x, E4M3).double() @ wt(w).double().T
    w_for_dgrad = wt(w) if r == "blockwise" else reference_quantize(w.T, E4M3, block=blk).T
    dx = act(g, gd).double() @ w_for_dgrad.double()
    dw = act(g.T, gd).double() @ act(x.T, E4M3).double().T
    return y, dx, dw


def run(x, w, g, recipe):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(x, w, None, Fp8Gemms(recipe))
    y.backward(g)
    return y.detach(), x.grad, w.grad


shapes = st.tuples(st.integers(1, 48), st.integers(1, 300), st.integers(1, 160))


@settings(max_examples=25, deadline=None)
@given(shape=shapes, log_range=st.integers(-6, 6), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_each_recipe_equals_quantize_dequantize_matmul(recipe, fmt, shape, log_range, seed):
    """Forward and both gradients within fp32 rounding of the reference's fp64 products of the
    same FP8 numbers (the only difference: fp32 accumulation, and for tensor-wise scaling
    _scaled_mm's reciprocal scales)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x, w, g = (torch.randn(*s, generator=gen) * 2.0**log_range for s in ((m, k), (n, k), (m, n)))
    rec = Fp8Recipe(fmt, recipe)
    for got, want in zip(run(x, w, g, rec), reference_linear(x, w, g, rec)):
        bound = 1e-5 * want.abs().max().item() + 1e-30
        assert (got.double() - want).abs().max().item() <= bound


def torchao_linear(lin, name):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = (
        Float8LinearConfig(emulate=True)
        if name == "tensorwise"
        else dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    )
    model = torch.nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(model, config=config)
    return model


@settings(max_examples=25, deadline=None)
@given(shape=shapes, log_range=st.integers(-4, 4), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_equals_torchaos_float8_linear_in_emulate_mode(name, shape, log_range, seed):
    """TorchAO's default (tensor-wise, e5m2 gradients: fmeg's hybrid) and its rowwise recipe
    (e4m3 throughout, power-of-two scales per row): rowwise bitwise (both dequantize and multiply
    in fp32), tensor-wise within fp32 rounding (fmeg runs it through torch._scaled_mm)."""
    m, k, n = shape
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k) * 2.0**log_range
    g = torch.randn(m, n)
    model = torchao_linear(lin, name)
    xa = x.clone().requires_grad_()
    ya = model(xa)
    ya.backward(g)
    fmt = "hybrid" if name == "tensorwise" else "e4m3"
    got = run(x, lin.weight.detach(), g, Fp8Recipe(fmt, name))
    for a, b in zip(got, (ya.detach(), xa.grad, model[0].weight.grad)):
        if name == "rowwise":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_zeros_stay_zero_and_inf_or_nan_is_never_silent(recipe):
    rec = Fp8Recipe("hybrid", recipe)
    w = torch.randn(16, 64)
    y, dx, dw = run(torch.zeros(8, 64), w, torch.ones(8, 16), rec)
    assert not y.any() and dx.isfinite().all() and not dw.any()
    for bad in (float("inf"), float("nan")):
        x = torch.randn(8, 64)
        x[3, 5] = bad
        assert run(x, w, torch.ones(8, 16), rec)[0].isnan().any()


def column_then_row(mesh, x, w1, w2, recipe):
    """An FP8 column-parallel then row-parallel pair at this rank's shards (tp over every rank):
    (its column output, the pair's output)."""
    from fmeg.fp8.plan import Fp8Layer
    from fmeg.parallel.tensor import TensorParallel, column_parallel_linear, row_parallel_linear

    tp = TensorParallel(mesh.group("tp"), fp8=Fp8Layer(recipe))
    r, t = mesh.coord("tp"), mesh.size("tp")
    h = column_parallel_linear(x, w1.chunk(t, 0)[r], None, tp)
    return h, row_parallel_linear(h, w2.chunk(t, 1)[r], None, tp)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_tensor_parallel_shards_use_one_devices_scales(recipe):
    """At tp 2 the column-parallel GEMM's output is bitwise the one-device output's shard (its
    input is whole, its weight's amax reduced over tp); the row-parallel GEMM's sum within fp32
    rounding of the one device's (the split sum's order is all that differs)."""
    from fmeg.parallel.spmd import run_threads

    rec = Fp8Recipe("hybrid", recipe)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 256, generator=gen)
    w1, w2 = torch.randn(512, 256, generator=gen), torch.randn(256, 512, generator=gen)
    h1, y1 = run_threads(1, column_then_row, x, w1, w2, rec, tp=1)[0]
    for r, (h, y) in enumerate(run_threads(2, column_then_row, x, w1, w2, rec, tp=2)):
        assert torch.equal(h, h1.chunk(2, -1)[r])
        torch.testing.assert_close(y, y1, rtol=1e-5, atol=1e-5 * y1.abs().max().item())
