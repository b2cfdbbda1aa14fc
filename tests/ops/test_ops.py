"""Each op equals a plain float64 reference written from its formula, in value and in gradients."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from fmeg import ops

f64 = torch.float64
seeds = st.integers(0, 2**31 - 1)


def randn(seed, *shape, dtype=f64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def assert_grads_match(fn, ref, args, argnums, rtol=1e-10, atol=1e-10):
    got = torch.func.grad(lambda *a: fn(*a).sum(), argnums=argnums)(*args)
    want = torch.func.grad(lambda *a: ref(*a).sum(), argnums=argnums)(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


@given(seeds, st.integers(1, 4), st.integers(1, 9), st.integers(1, 9), st.booleans())
def test_linear_is_x_wT_plus_b(seed, batch, n_in, n_out, bias):
    x, w = randn(seed, batch, n_in), randn(seed + 1, n_out, n_in)
    b = randn(seed + 2, n_out) if bias else None
    ref = lambda x, w: (
        sum(x[:, None, i] * w[None, :, i] for i in range(n_in)) + (0 if b is None else b)
    )
    torch.testing.assert_close(ops.linear(x, w, b), ref(x, w))
    assert_grads_match(lambda x, w: ops.linear(x, w, b), ref, (x, w), (0, 1))


@given(seeds, st.integers(1, 3), st.integers(1, 5), st.integers(1, 6))
def test_stacked_linear_flattens_leading_dims_in_order(seed, stack, out, n_in):
    x, w, b = randn(seed, 2, n_in), randn(seed + 1, stack, out, n_in), randn(seed + 2, stack, out)
    got = ops.linear(x, w, b)
    want = torch.cat([x @ w[i].T + b[i] for i in range(stack)], dim=-1)
    torch.testing.assert_close(got, want)


@given(seeds, st.integers(1, 4), st.integers(2, 33), st.sampled_from([1e-5, 1e-6, 1e-2]))
def test_layer_norm_formula(seed, rows, h, eps):
    x, w, b = randn(seed, rows, h) * 3 + 1, randn(seed + 1, h), randn(seed + 2, h)

    def ref(x, w, b):
        mean = x.sum(-1, keepdim=True) / h
        var = ((x - mean) ** 2).sum(-1, keepdim=True) / h
        return (x - mean) / torch.sqrt(var + eps) * w + b

    torch.testing.assert_close(ops.layer_norm(x, w, b, eps), ref(x, w, b))
    assert_grads_match(lambda x, w, b: ops.layer_norm(x, w, b, eps), ref, (x, w, b), (0, 1, 2))


@given(seeds, st.integers(1, 4), st.integers(1, 33), st.sampled_from([1e-5, 1e-6]))
def test_rms_norm_formula(seed, rows, h, eps):
    x, w = randn(seed, rows, h) * 2, randn(seed + 1, h)
    ref = lambda x, w: x / torch.sqrt((x * x).sum(-1, keepdim=True) / h + eps) * w
    torch.testing.assert_close(ops.rms_norm(x, w, eps), ref(x, w))
    assert_grads_match(lambda x, w: ops.rms_norm(x, w, eps), ref, (x, w), (0, 1))


def test_norms_compute_in_fp32_for_bf16_inputs():
    x = randn(0, 4, 64, dtype=torch.float32) * 100
    w = torch.ones(64)
    got = ops.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), ops.rms_norm(x.bfloat16().float(), w, 1e-6), rtol=1e-2, atol=1e-2
    )


@given(seeds, st.integers(1, 50))
def test_activations_formulas(seed, n):
    x, y = randn(seed, n) * 3, randn(seed + 1, n)
    gelu = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    gelu_tanh = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    swiglu = lambda a, b: a / (1 + torch.exp(-a)) * b
    torch.testing.assert_close(ops.gelu(x), gelu(x))
    torch.testing.assert_close(ops.gelu_tanh(x), gelu_tanh(x))
    torch.testing.assert_close(ops.swiglu(x, y), swiglu(x, y))
    assert_grads_match(ops.gelu, gelu, (x,), (0,))
    assert_grads_match(ops.gelu_tanh, gelu_tanh, (x,), (0,))
    assert_grads_match(ops.swiglu, swiglu, (x, y), (0, 1))


@given(seeds, st.integers(1, 6), st.integers(1, 12), st.integers(1, 8))
def test_embedding_is_row_lookup(seed, vocab, n, dim):
    table = randn(seed, vocab, dim)
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(
        ops.embedding(ids, table), torch.stack([table[i] for i in ids.tolist()])
    )
    grad = torch.func.grad(lambda t: ops.embedding(ids, t).sum())(table)
    counts = torch.bincount(ids, minlength=vocab).to(f64)
    torch.testing.assert_close(grad, counts[:, None].expand(vocab, dim))


@given(
    seeds, st.integers(1, 8), st.sampled_from([2, 4, 8, 16]), st.sampled_from([10000.0, 500000.0])
)
def test_rope_rotates_pairs_as_complex_numbers(seed, seq, d, theta):
    x = randn(seed, 2, 3, seq, d)
    pos = torch.arange(seq) + seed % 7
    cos, sin = ops.rope_cos_sin(pos, d, theta)
    got = ops.apply_rope(x, cos.to(f64), sin.to(f64))
    # Reference: pair (i, i + d/2) is the complex number x_i + j x_{i+d/2}, rotated by pos *
    # theta^(-2i/d).
    half = d // 2
    angle = pos[:, None].to(f64) * theta ** (-torch.arange(half, dtype=f64) * 2 / d)
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat([z.real, z.imag], dim=-1)
    # tables are fp32, as in Hugging Face
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    q, k = randn(0, 1, 1, 1, 8).expand(1, 1, 6, 8), randn(1, 1, 1, 1, 8).expand(1, 1, 6, 8)
    cos, sin = ops.rope_cos_sin(torch.arange(6), 8, 10000.0)
    qr, kr = (
        ops.apply_rope(q, cos.to(f64), sin.to(f64)),
        ops.apply_rope(k, cos.to(f64), sin.to(f64)),
    )
    scores = qr[0, 0] @ kr[0, 0].T
    for delta in range(-3, 4):
        diag = torch.diagonal(scores, offset=delta)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=1e-5, atol=1e-5)


def attention_reference(q, k, v):
    n, g, s, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k, v = k.repeat_interleave(n // g, dim=1), v.repeat_interleave(n // g, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@given(
    seeds,
    st.integers(1, 2),
    st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (6, 3)]),
    st.integers(1, 9),
    st.sampled_from([4, 8]),
)
def test_causal_attention_with_grouped_query_heads(seed, b, heads, s, d):
    n, g = heads
    q, k, v = randn(seed, b, n, s, d), randn(seed + 1, b, g, s, d), randn(seed + 2, b, g, s, d)
    torch.testing.assert_close(ops.causal_attention(q, k, v), attention_reference(q, k, v))
    assert_grads_match(ops.causal_attention, attention_reference, (q, k, v), (0, 1, 2))
    with sdpa_kernel(SDPBackend.MATH):
        tangents = (
            randn(seed + 3, b, n, s, d),
            randn(seed + 4, b, g, s, d),
            randn(seed + 5, b, g, s, d),
        )
        _, got = torch.func.jvp(ops.causal_attention, (q, k, v), tangents)
        _, want = torch.func.jvp(attention_reference, (q, k, v), tangents)
        torch.testing.assert_close(got, want)


def attention_dropout_reference(q, k, v, p, key, head_offset, total_heads):
    """Probabilities dropped where uniform(key, global flat position in [b, total_heads, s, s]) <
    p."""
    n, g, s, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k, v = k.repeat_interleave(n // g, dim=1), v.repeat_interleave(n // g, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(
        torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")
    )
    probs = torch.softmax(scores, dim=-1)
    index = torch.tensor(
        [
            [
                [
                    [((row * total_heads + head_offset + h) * s + i) * s + j for j in range(s)]
                    for i in range(s)
                ]
                for h in range(n)
            ]
            for row in range(q.shape[0])
        ]
    )
    keep = (ops.uniform(key, index) >= p).to(q.dtype)
    return (probs * keep / (1 - p)) @ v


@given(
    seeds,
    st.integers(1, 2),
    st.sampled_from([(2, 1), (4, 2), (4, 4)]),
    st.integers(1, 7),
    st.sampled_from([0.1, 0.5]),
    st.integers(0, 4),
)
def test_attention_dropout_against_a_global_position_reference(seed, b, heads, s, p, head_offset):
    n, g = heads
    q, k, v = randn(seed, b, n, s, 4), randn(seed + 1, b, g, s, 4), randn(seed + 2, b, g, s, 4)
    key, total = torch.tensor(seed), n + head_offset + 1

    def fn(q, k, v):
        return ops.causal_attention(
            q, k, v, dropout_p=p, key=key, head_offset=head_offset, total_heads=total
        )

    def ref(q, k, v):
        return attention_dropout_reference(q, k, v, p, key, head_offset, total)

    torch.testing.assert_close(fn(q, k, v), ref(q, k, v))
    assert_grads_match(fn, ref, (q, k, v), (0, 1, 2))
    tangents = (
        randn(seed + 3, b, n, s, 4),
        randn(seed + 4, b, g, s, 4),
        randn(seed + 5, b, g, s, 4),
    )
    torch.testing.assert_close(
        torch.func.jvp(fn, (q, k, v), tangents)[1], torch.func.jvp(ref, (q, k, v), tangents)[1]
    )


def test_attention_dropout_mask_does_not_depend_on_the_head_split():
    q, k, v = randn(0, 2, 4, 6, 4), randn(1, 2, 2, 6, 4), randn(2, 2, 2, 6, 4)
    whole = ops.causal_attention(q, k, v, dropout_p=0.3, key=5)
    halves = [
        ops.causal_attention(
            q[:, 2 * r : 2 * r + 2],
            k[:, r : r + 1],
            v[:, r : r + 1],
            dropout_p=0.3,
            key=5,
            head_offset=2 * r,
            total_heads=4,
        )
        for r in range(2)
    ]
    torch.testing.assert_close(torch.cat(halves, dim=1), whole)
    assert not torch.allclose(whole, ops.causal_attention(q, k, v)), "dropout changed nothing"


def test_causal_attention_ignores_the_future():
    q, k, v = randn(0, 1, 2, 5, 4), randn(1, 1, 2, 5, 4), randn(2, 1, 2, 5, 4)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 3:], v2[:, :, 3:] = 99.0, -99.0
    torch.testing.assert_close(
        ops.causal_attention(q, k, v)[:, :, :3], ops.causal_attention(q, k2, v2)[:, :, :3]
    )


def cross_entropy_reference(logits, labels, mask, eps):
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    valid = (labels != -100).to(f64) * mask
    target = logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    per_token = -(1 - eps) * target - eps * logp.mean(-1)
    return (per_token * valid).sum() / valid.sum().clamp_min(1)


ce_cases = given(
    seeds,
    st.integers(1, 3),
    st.integers(1, 7),
    st.integers(2, 13),
    st.sampled_from([0.0, 0.1, 0.3]),
    st.booleans(),
)


def ce_inputs(seed, b, s, v, masked):
    gen = torch.Generator().manual_seed(seed)
    logits = randn(seed, b, s, v) * 3
    labels = torch.randint(0, v, (b, s), generator=gen)
    labels[torch.rand(b, s, generator=gen) < 0.2] = -100
    mask = (
        (torch.rand(b, s, generator=gen) < 0.7).to(f64) if masked else torch.ones(b, s, dtype=f64)
    )
    return logits, labels, mask


@ce_cases
def test_cross_entropy_with_ignore_mask_and_smoothing(seed, b, s, v, eps, masked):
    logits, labels, mask = ce_inputs(seed, b, s, v, masked)
    fn = lambda lg: ops.cross_entropy(lg, labels, loss_mask=mask, label_smoothing=eps)
    ref = lambda lg: cross_entropy_reference(lg, labels, mask, eps)
    torch.testing.assert_close(fn(logits), ref(logits))
    assert_grads_match(fn, ref, (logits,), (0,))
    if not masked:
        want = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1), label_smoothing=eps)
        if (labels != -100).any():
            torch.testing.assert_close(fn(logits), want)


@ce_cases
def test_linear_cross_entropy_equals_cross_entropy_of_linear(seed, b, s, v, eps, masked):
    _, labels, mask = ce_inputs(seed, b, s, v, masked)
    x, w = randn(seed + 1, b, s, 5), randn(seed + 2, v, 5)
    fused = lambda x, w: ops.linear_cross_entropy(x, w, labels, loss_mask=mask, label_smoothing=eps)
    plain = lambda x, w: ops.cross_entropy(
        ops.linear(x, w), labels, loss_mask=mask, label_smoothing=eps
    )
    torch.testing.assert_close(fused(x, w), plain(x, w))
    assert_grads_match(fused, plain, (x, w), (0, 1))
    tangents = (randn(seed + 3, b, s, 5), randn(seed + 4, v, 5))
    torch.testing.assert_close(
        torch.func.jvp(fused, (x, w), tangents)[1], torch.func.jvp(plain, (x, w), tangents)[1]
    )
    xs = randn(seed + 5, 3, b, s, 5)
    batched = lambda f: torch.func.vmap(torch.func.grad(f), in_dims=(0, None))(xs, w)
    torch.testing.assert_close(batched(fused), batched(plain))
    x_leaf = x.clone().requires_grad_()
    fused(x_leaf, w).backward()
    torch.testing.assert_close(x_leaf.grad, torch.func.grad(plain)(x, w))


def test_causal_attention_compiles_with_dynamic_head_counts():
    """Under dynamic shapes the head counts are symbolic: attention must not hand SDPA a SymBool."""
    compiled = torch.compile(ops.causal_attention, dynamic=True, fullgraph=True, backend="eager")
    for n, g in ((4, 4), (6, 6), (4, 2), (6, 3)):
        q, k, v = randn(n, 2, n, 5, 4), randn(n + 1, 2, g, 5, 4), randn(n + 2, 2, g, 5, 4)
        torch.testing.assert_close(compiled(q, k, v), attention_reference(q, k, v))


@ce_cases
def test_linear_cross_entropy_over_a_padded_weight_equals_it_over_the_real_rows(
    seed, b, s, v, eps, masked
):
    """vocab_size=v with weight padded to v + 3 rows: the loss and x's gradient are those of
    weight[:v] (and so of the unfused op), the padding rows' gradient is exactly zero; forward-mode
    and compiled too."""
    _, labels, mask = ce_inputs(seed, b, s, v, masked)
    x, w = randn(seed + 1, b, s, 5), randn(seed + 2, v + 3, 5)
    padded = lambda x, w: ops.linear_cross_entropy(
        x, w, labels, loss_mask=mask, label_smoothing=eps, vocab_size=v
    )
    plain = lambda x, w: ops.cross_entropy(
        ops.linear(x, w[:v]), labels, loss_mask=mask, label_smoothing=eps
    )
    torch.testing.assert_close(padded(x, w), plain(x, w))
    assert_grads_match(padded, plain, (x, w), (0, 1))
    gw = torch.func.grad(padded, argnums=1)(x, w)
    assert torch.equal(gw[v:], torch.zeros_like(gw[v:]))
    tangents = (randn(seed + 3, b, s, 5), randn(seed + 4, v + 3, 5))
    torch.testing.assert_close(
        torch.func.jvp(padded, (x, w), tangents)[1], torch.func.jvp(plain, (x, w), tangents)[1]
    )
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.compile(padded, backend="aot_eager", fullgraph=True)(x_leaf, w_leaf).backward()
    torch.testing.assert_close(x_leaf.grad, torch.func.grad(plain)(x, w))
    torch.testing.assert_close(w_leaf.grad, gw)


def test_dropout_is_a_pure_function_of_key_and_index():
    x = torch.ones(64, 64)
    a, b, c = ops.dropout(x, 0.25, 7), ops.dropout(x, 0.25, 7), ops.dropout(x, 0.25, 8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    dropped = (a == 0).float().mean().item()
    assert abs(dropped - 0.25) < 0.02, dropped
    assert abs(a.mean().item() - 1.0) < 0.03
    assert set(torch.unique(a).tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
    assert torch.equal(ops.dropout(x, 0.0, 7), x)


def test_dropout_mask_follows_global_index_not_shard():
    full = ops.dropout(torch.ones(8, 12), 0.5, 3)
    index = torch.arange(96).view(8, 12)
    for shard in range(3):
        cols = slice(4 * shard, 4 * shard + 4)
        got = ops.dropout(torch.ones(8, 4), 0.5, 3, index=index[:, cols])
        assert torch.equal(got, full[:, cols])


def test_uniform_bits_look_uniform():
    u = ops.uniform(123, torch.arange(200_000))
    assert 0.0 <= u.min() and u.max() < 1.0
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    # Neighbouring counters are uncorrelated.
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01


def test_dropout_gradient_uses_the_same_mask():
    x = randn(0, 16, 16)
    g = torch.func.grad(lambda x: ops.dropout(x, 0.3, 5).sum())(x)
    torch.testing.assert_close(g, ops.dropout(torch.ones_like(x), 0.3, 5))


def test_fold_in_gives_distinct_streams():
    keys = {int(ops.fold_in(0, layer, site)) for layer in range(16) for site in range(2)}
    assert len(keys) == 32


def test_linear_cross_entropy_gradients_under_torch_compile():
    x, w = randn(0, 6, 5, dtype=torch.float32), randn(1, 9, 5, dtype=torch.float32)
    labels = torch.tensor([0, 3, -100, 8, 2, 2])
    fn = torch.func.grad(
        lambda x, w: ops.linear_cross_entropy(x, w, labels, label_smoothing=0.1), argnums=(0, 1)
    )
    for got, want in zip(torch.compile(fn)(x, w), fn(x, w)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_in_a_compute_dtype_stays_close_to_fp32(dtype):
    """Forward and backward GEMMs run in the inputs' dtype (fp32 accumulation, fp32 softmax): the
    loss and gradients are the fp32 ones to that dtype's rounding, and the gradients come back in
    that dtype."""
    x, w = randn(0, 64, 32, dtype=torch.float32), randn(1, 300, 32, dtype=torch.float32) * 0.3
    labels = torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(2))
    fn = torch.func.grad_and_value(
        lambda x, w: ops.linear_cross_entropy(x, w, labels, label_smoothing=0.1), argnums=(0, 1)
    )
    (gx, gw), loss = fn(x.to(dtype), w.to(dtype))
    (want_gx, want_gw), want_loss = fn(x, w)
    assert gx.dtype == gw.dtype == dtype and loss.dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=0)
    for got, want in ((gx, want_gx), (gw, want_gw)):
        assert (got.float() - want).norm() <= 2e-2 * want.norm()
