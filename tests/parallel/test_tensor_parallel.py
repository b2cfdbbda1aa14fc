"""Tensor- and sequence-parallel transforms equal their single-device counterparts, in value and in
every gradient; the vocabulary-parallel loss equals F.cross_entropy (smoothing included) and
megatron-core."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import spmd_programs as P
from harness.parallel import run

f64 = torch.float64
BACKENDS = [("threads", None), ("gloo", 2), ("gloo", 4)]


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend, fixed_world", BACKENDS)
@settings(max_examples=8)
@given(data=st.data(), sp=st.booleans())
def test_column_then_row_parallel_mlp(backend, fixed_world, data, sp):
    world = fixed_world or data.draw(st.integers(1, 4), label="world")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    b, s, h, f = (
        data.draw(st.integers(1, 2)),
        world * data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 5)),
        world * data.draw(st.integers(1, 3)),
    )
    x = torch.randn(b, s, h, generator=gen, dtype=f64)
    params = tuple(
        torch.randn(*shape, generator=gen, dtype=f64) for shape in ((f, h), (f,), (h, f), (h,))
    )

    def ref(x, p):
        y = F.linear(F.gelu(F.linear(x, p[0], p[1])), p[2], p[3])
        return y, (y**2).sum()

    y = ref(x, params)[0]
    gx, gp = torch.func.grad(lambda x, p: ref(x, p)[1], argnums=(0, 1))(x, params)
    for r, got in enumerate(run(backend, world, P.parallel_mlp, x, params, sp)):
        chunk = lambda t, d: t.chunk(world, dim=d)[r]  # noqa: E731
        close(got["out"], chunk(y, 1) if sp else y)
        close(got["grad_x"], chunk(gx, 1) if sp else gx)
        want_p = (chunk(gp[0], 0), chunk(gp[1], 0), chunk(gp[2], 1), gp[3])
        for g, w in zip(got["grad_p"], want_p):
            close(g, w)


@pytest.mark.parametrize("backend, fixed_world", BACKENDS)
@settings(max_examples=8)
@given(data=st.data(), sp=st.booleans())
def test_vocab_parallel_embedding(backend, fixed_world, data, sp):
    world = fixed_world or data.draw(st.integers(1, 4), label="world")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    vocab, b, s, h = (
        world * data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 2)),
        world * data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 4)),
    )
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    table = torch.randn(vocab, h, generator=gen, dtype=f64)
    weights = torch.randn(b, s, h, generator=gen, dtype=f64)
    out = F.embedding(ids, table)
    want = torch.func.grad(lambda t: (F.embedding(ids, t) * weights).sum())(table)
    for r, got in enumerate(run(backend, world, P.parallel_embedding, ids, table, weights, sp)):
        chunk = lambda t, d: t.chunk(world, dim=d)[r]  # noqa: E731
        close(got["out"], chunk(out, 1) if sp else out)
        close(got["grad"], chunk(want, 0))


@pytest.mark.parametrize("backend, fixed_world", BACKENDS)
@settings(max_examples=10)
@given(data=st.data(), smoothing=st.sampled_from([0.0, 0.1, 0.25]))
def test_vocab_parallel_cross_entropy_equals_cross_entropy(backend, fixed_world, data, smoothing):
    """Over a padded vocabulary too: the reference sees only the first `real` columns, so padding
    ids must take no part in the softmax or the smoothing mean and get zero gradient (even a rank of
    padding only)."""
    world = fixed_world or data.draw(st.integers(1, 4), label="world")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    vocab, b, s = (
        world * data.draw(st.integers(1, 5)),
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 4)),
    )
    real = vocab - data.draw(st.integers(0, vocab - 1), label="padding")
    logits = torch.randn(b, s, vocab, generator=gen, dtype=f64) * 4
    labels = torch.randint(0, real, (b, s), generator=gen)
    labels[0, 0] = -100
    cot, tan, batch = (
        torch.randn(b, s, generator=gen, dtype=f64),
        torch.randn_like(logits),
        torch.randn(2, b, s, vocab, generator=gen, dtype=f64),
    )

    def ref(lg):
        return F.cross_entropy(
            lg[..., :real].reshape(-1, real),
            labels.reshape(-1),
            reduction="none",
            label_smoothing=smoothing,
        ).view(b, s)

    out, vjp = torch.func.vjp(ref, logits)
    vocab_size = None if real == vocab else real  # both forms: unpadded, and padded
    for r, got in enumerate(
        run(
            backend,
            world,
            P.parallel_cross_entropy,
            logits,
            labels,
            smoothing,
            cot,
            tan,
            batch,
            vocab_size,
        )
    ):
        chunk = lambda t: t.chunk(world, dim=-1)[r]  # noqa: E731
        close(got["out"], out)
        close(got["grad"], chunk(vjp(cot)[0]))
        close(got["vmap"], torch.func.vmap(ref)(batch))
        if backend == "threads":
            assert got["jvp"] is None
        else:
            close(got["jvp"], torch.func.jvp(ref, (logits,), (tan,))[1])


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_equals_megatron_core(world):
    pytest.importorskip("megatron.core.tensor_parallel")
    gen = torch.Generator().manual_seed(world)
    logits, labels = (
        torch.randn(5, 3, 8 * world, generator=gen) * 3,
        torch.randint(0, 8 * world, (5, 3), generator=gen),
    )
    theirs = run("gloo", world, P.megatron_vocab_parallel_cross_entropy, logits, labels)
    ours = run(
        "gloo",
        world,
        P.parallel_cross_entropy,
        logits.double(),
        labels,
        0.0,
        torch.zeros(5, 3, dtype=f64),
        torch.zeros_like(logits, dtype=f64),
        torch.zeros(2, *logits.shape, dtype=f64),
    )
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(t.double(), o["out"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sp", [False, True])
def test_collective_volume_of_one_layer_matches_the_analytic_count(sp):
    from fmeg.models import gpt

    config = gpt.GPTConfig.gpt2(
        vocab_size=16, max_seq_len=8, num_layers=1, hidden_size=16, num_heads=4
    )
    b, s, h = 2, 8, 16
    layer = gpt.init(config, 0)["layers"][0]
    x = torch.randn(b, s, h)
    logs = run("threads", 2, P.recorded_layer_volume, layer, x, config, sp)
    bsh = b * s * h * 4  # fp32 bytes of one activation
    for log in logs:
        ops = [op for op, _ in log]
        volume = sum(n for op, n in log if n == bsh)
        if sp:
            assert sorted(ops[:4]) == [
                "all_gather",
                "all_gather",
                "reduce_scatter",
                "reduce_scatter",
            ]
            assert (
                sorted(o for o, n in log if n == bsh) == ["all_gather"] * 4 + ["reduce_scatter"] * 4
            )
        else:
            assert [o for o, n in log if n == bsh] == ["all_reduce"] * 4  # 2 forward, 2 backward
        assert volume == 4 * bsh if not sp else 8 * bsh
        # What is left is the gradient all-reduce of the replicated norm weights and biases (SP
        # only).
        small = [(o, n) for o, n in log if n != bsh]
        assert all(o == "all_reduce" and n <= h * 4 for o, n in small) and (
            len(small) == 6 if sp else not small
        )
