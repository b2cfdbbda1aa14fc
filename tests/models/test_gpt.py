"""The GPT as pure functions: config validation, deterministic init, and apply/loss contracts."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg import ops, tree
from fmeg.models import gpt, self_attention

TINY = dict(vocab_size=37, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4)


def tiny(style="gpt2", **kw):
    base = {**TINY, "num_kv_heads": 2} if style == "llama" else TINY
    return getattr(gpt.GPTConfig, style)(**{**base, **kw})


def batch_for(config, b=2, s=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    return {"tokens": t[:, :-1], "labels": t[:, 1:]}


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("hidden_size", dict(hidden_size=30)),
        ("num_kv_heads", dict(num_kv_heads=3)),
        ("norm", dict(norm="batchnorm")),
        ("activation", dict(activation="relu")),
        ("position", dict(position="alibi")),
        ("vocab_size", dict(vocab_size=0)),
        ("padded_vocab_size", dict(padded_vocab_size=30)),
        ("hidden_dropout", dict(hidden_dropout=1.0)),
        ("position", dict(hidden_size=36, num_heads=12, position="rope")),
    ],
)
def test_invalid_configs_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}"):
        tiny(**kwargs)


def test_defaults_follow_the_usual_rules():
    assert tiny().ffn_hidden_size == 128 and tiny().num_kv_heads == 4
    # 8/3 * 96 -> multiple of 64
    assert tiny("llama", hidden_size=96, num_kv_heads=2).ffn_hidden_size == 256
    assert gpt.GPTConfig.gpt2().hidden_size == 768 and gpt.GPTConfig.llama().num_kv_heads == 8


def test_paths_are_readable_and_complete():
    names = set(tree.flatten(gpt.init(tiny("llama"), 0)))
    assert {
        "embedding.word.weight",
        "layers.1.attn.qkv.weight",
        "layers.0.mlp.fc1.weight",
        "output.weight",
        "final_norm.weight",
    } <= names
    assert "embedding.position.weight" not in names and not any(n.endswith("bias") for n in names)
    gpt2_names = set(tree.flatten(gpt.init(tiny(), 0)))
    assert "output.weight" not in gpt2_names and "layers.0.attn.qkv.bias" in gpt2_names


def test_init_is_bitwise_deterministic_and_per_leaf():
    c = tiny("llama")
    a, b, other = gpt.init(c, 5), gpt.init(c, 5), gpt.init(c, 6)
    assert all(torch.equal(x, y) for x, y in zip(tree.tree_leaves(a), tree.tree_leaves(b)))
    assert not torch.equal(
        a["layers"][0]["attn"]["qkv"]["weight"], other["layers"][0]["attn"]["qkv"]["weight"]
    )
    # A leaf does not depend on which others exist: one layer alone equals that layer of the whole
    # model.
    alone = gpt.init_layer(c, 5, 1)
    assert all(
        torch.equal(x, y) for x, y in zip(tree.tree_leaves(alone), tree.tree_leaves(a["layers"][1]))
    )
    # A deeper model's first layers have the same draws (only output-projection std is
    # depth-scaled).
    deeper = gpt.init(c.replace(num_layers=3), 5)
    assert torch.equal(
        deeper["layers"][0]["attn"]["qkv"]["weight"], a["layers"][0]["attn"]["qkv"]["weight"]
    )


def test_init_statistics_follow_megatron():
    c = tiny(hidden_size=256, num_heads=4, num_layers=8, vocab_size=1000)
    p = gpt.init(c, 0)
    assert abs(p["layers"][0]["attn"]["qkv"]["weight"].std().item() - 0.02) < 1e-3
    # / sqrt(2 * 8)
    assert abs(p["layers"][0]["mlp"]["fc2"]["weight"].std().item() - 0.02 / 4) < 3e-4
    assert torch.equal(p["layers"][0]["attn_norm"]["weight"], torch.ones(256))


@given(st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3)]), st.integers(1, 3), st.integers(0, 1000))
def test_fuse_and_split_qkv_round_trip(heads, rows_per_dim, seed):
    n, g = heads
    c = tiny("llama", hidden_size=8 * n, num_heads=n, num_kv_heads=g)
    d = c.head_dim
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(m * d, rows_per_dim, generator=gen) for m in (n, g, g))
    fused = self_attention.fuse_qkv(q, k, v, g)
    for got, want in zip(self_attention.split_qkv(fused, c), (q, k, v)):
        assert torch.equal(got, want)
    # Group 0 comes first and holds query heads 0..n/g-1, then its key, then its value.
    assert torch.equal(fused[: (n // g) * d], q[: (n // g) * d])
    assert torch.equal(fused[(n // g) * d : (n // g + 1) * d], k[:d])


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_loss_equals_cross_entropy_of_apply(style):
    c = tiny(style)
    p, batch = gpt.init(c, 0), batch_for(c)
    batch["loss_mask"] = (torch.arange(8) % 3 != 0).float().expand(2, 8)
    logits = gpt.apply(p, batch["tokens"], c)
    assert logits.shape == (2, 8, c.vocab_size)
    want = ops.cross_entropy(logits, batch["labels"], loss_mask=batch["loss_mask"])
    torch.testing.assert_close(gpt.loss(p, batch, c), want)
    g_fused = torch.func.grad(gpt.loss)(p, batch, c)
    g_plain = torch.func.grad(
        lambda p: ops.cross_entropy(
            gpt.apply(p, batch["tokens"], c), batch["labels"], loss_mask=batch["loss_mask"]
        )
    )(p)
    for (path, a), b in zip(tree.items(g_fused), tree.tree_leaves(g_plain)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=path)


@given(
    style=st.sampled_from(["gpt2", "llama"]),
    padding=st.integers(0, 200),
    smoothing=st.sampled_from([0.0, 0.1]),
)
def test_vocabulary_padding_changes_no_number(style, padding, smoothing):
    """Real rows are drawn as without padding and padding rows are zero; logits cover the real
    vocabulary; the loss (label smoothing over the real vocabulary) and the real rows' gradients are
    the unpadded model's, and padding rows get no gradient, tied (gpt2) or untied (llama)."""
    c = tiny(style)
    cp = c.replace(padded_vocab_size=c.vocab_size + padding)
    p, pp, batch = gpt.init(c, 0), gpt.init(cp, 0), batch_for(c)
    for path in gpt.VOCAB_TABLES:
        if path in tree.flatten(p):
            table = tree.flatten(pp)[path]
            assert table.shape[0] == cp.padded_vocab_size and not table[c.vocab_size :].any()
            assert torch.equal(table[: c.vocab_size], tree.flatten(p)[path])
    assert torch.equal(gpt.apply(pp, batch["tokens"], cp), gpt.apply(p, batch["tokens"], c))
    want, want_loss = torch.func.grad_and_value(
        lambda q: gpt.loss(q, batch, c, label_smoothing=smoothing)
    )(p)
    got, loss = torch.func.grad_and_value(
        lambda q: gpt.loss(q, batch, cp, label_smoothing=smoothing)
    )(pp)
    assert torch.equal(loss, want_loss)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            tree.tree_leaves(gpt.repad_vocab(got, cp, c.vocab_size)), tree.tree_leaves(want)
        )
    )
    assert all(
        not tree.flatten(got)[path][c.vocab_size :].any()
        for path in gpt.VOCAB_TABLES
        if path in tree.flatten(got)
    )


def test_apply_is_causal():
    c = tiny("llama")
    p = gpt.init(c, 0)
    t = batch_for(c)["tokens"]
    t2 = t.clone()
    t2[:, 5:] = (t2[:, 5:] + 1) % c.vocab_size
    torch.testing.assert_close(gpt.apply(p, t, c)[:, :5], gpt.apply(p, t2, c)[:, :5])


def test_sequence_longer_than_max_is_rejected():
    c = tiny()
    with pytest.raises(ValueError, match="max_seq_len"):
        gpt.apply(gpt.init(c, 0), torch.zeros(1, 17, dtype=torch.long), c)


def test_dropout_needs_a_key_and_depends_on_it():
    c = tiny(hidden_dropout=0.2)
    p, batch = gpt.init(c, 0), batch_for(c)
    no_key = gpt.loss(p, batch, c)
    torch.testing.assert_close(no_key, gpt.loss(p, batch, c.replace(hidden_dropout=0.0)))
    k1, k1b, k2 = (gpt.loss(p, batch, c, key=torch.tensor(k)) for k in (1, 1, 2))
    assert torch.equal(k1, k1b) and not torch.equal(k1, k2) and not torch.equal(k1, no_key)


def test_vmap_over_a_stack_of_models_is_an_ensemble():
    c = tiny()
    models = [gpt.init(c, s) for s in range(3)]
    stacked = tree.tree_map(lambda *xs: torch.stack(xs), *models)
    batch = batch_for(c)
    losses = torch.func.vmap(lambda p: gpt.loss(p, batch, c))(stacked)
    torch.testing.assert_close(losses, torch.stack([gpt.loss(m, batch, c) for m in models]))


def test_params_in_bf16_run_and_stay_bf16():
    c = tiny("llama")
    p = gpt.init(c, 0, dtype=torch.bfloat16)
    logits = gpt.apply(p, batch_for(c)["tokens"], c)
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(
        logits.float(), gpt.apply(gpt.init(c, 0), batch_for(c)["tokens"], c), rtol=0.05, atol=0.05
    )
