"""GPT-OSS's pieces (attention sinks, sliding windows, the clamped quick-GEGLU, biases, YaRN)
against megatron-core's GPTModel on the same weights, and the sink/window attention on its own."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import megatron_gpt
from fmeg import ops, tree
from fmeg.models import gpt
from harness.parallel import gloo


def oss_config(**overrides) -> gpt.GPTConfig:
    base = dict(
        vocab_size=64,
        max_seq_len=32,
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        norm="rmsnorm",
        activation="quick_geglu",
        position="rope",
        bias=True,
        tie_embeddings=False,
        softmax_type="learnable",
        window_size=3,
        window_attn_skip_freq=2,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.3,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=4,
        yarn_round_to_int=False,
        init_std=0.1,
    )
    return gpt.GPTConfig(**{**base, **overrides})


def randomized(params):
    """Biases, norms and sinks away from their init, so that a misplaced one shows."""
    with torch.no_grad():
        for path, leaf in tree.items(params):
            if "norm" in path or "bias" in path or "sinks" in path:
                leaf.add_(
                    0.3
                    * torch.randn(leaf.shape, generator=torch.Generator().manual_seed(len(path)))
                )
    return params


def batch_of(config, b=2, s=16, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": (torch.rand(b, s, generator=gen) > 0.25).float(),
    }


@pytest.mark.parametrize(
    "overrides",
    [
        # learnable sinks, windows of 3 on layers 1 and 3, YaRN without rounding, the clamped GEGLU
        # with offset
        {},
        {"softmax_type": "off-by-one", "window_attn_skip_freq": (0, 1, 1), "rope_type": "rope"},
        {
            "softmax_type": "vanilla",
            "window_attn_skip_freq": None,
            "window_size": 5,
            "yarn_round_to_int": True,
        },
    ],
    ids=["learnable", "off_by_one_listed_windows", "windows_everywhere"],
)
def test_gpt_oss_model_equals_megatron_cores_gpt_model(overrides):
    pytest.importorskip("megatron.core")
    config = oss_config(**overrides)
    params = randomized(gpt.init(config, 3))
    batch = batch_of(config)
    want_lm, _, want_grads = gloo(1).run(megatron_gpt.megatron_gpt, params, batch, config, tp=1)[0]
    grads, lm = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config))(params)
    assert abs(lm.item() - want_lm) < 1e-5
    for path, g in tree.items(grads):
        torch.testing.assert_close(g, want_grads[path], atol=1e-5, rtol=1e-4, msg=path)


def reference(q, k, v, window, sinks, documents):
    """Each query on its own: its visible keys by the definition, softmax with the sink appended."""
    b, n, s, d = q.shape
    k, v = (t.repeat_interleave(n // k.shape[1], dim=1) for t in (k, v))
    out = torch.zeros_like(q)
    for row in range(b):
        bounds = documents[row].tolist()
        for i in range(s):
            start = max(a for a in bounds if a <= i)
            lo = max(start, 0 if window is None else i - window)
            scores = torch.einsum("nd,nkd->nk", q[row, :, i], k[row, :, lo : i + 1]) * d**-0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks[:, None]], dim=1)
            probs = scores.softmax(-1)[:, : i + 1 - lo]
            out[row, :, i] = torch.einsum("nk,nkd->nd", probs, v[row, :, lo : i + 1])
    return out


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_sink_attention_sees_what_its_definition_says(data):
    s, window = data.draw(st.integers(1, 9)), data.draw(st.one_of(st.none(), st.integers(0, 10)))
    groups, per = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 2]))
    cuts = sorted(data.draw(st.lists(st.integers(0, s), max_size=3)))
    documents = torch.tensor([[0, *cuts, s], [0, s, s, s, s][: len(cuts) + 2]])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    q = torch.randn(2, groups * per, s, 4, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, groups, s, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = data.draw(
        st.sampled_from([None, torch.randn(groups * per, generator=gen, dtype=torch.float64)])
    )
    pos = torch.arange(s)
    keep = ops.visible(pos, pos, window, documents)
    got = ops.sink_attention(q, k, v, keep, sinks=sinks)
    torch.testing.assert_close(got, reference(q, k, v, window, sinks, documents))


def test_a_window_as_long_as_the_sequence_and_no_sinks_is_causal_attention():
    q, k, v = (torch.randn(2, 4, 7, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(7)
    got = ops.sink_attention(q, k, v, ops.visible(pos, pos, window=6))
    torch.testing.assert_close(got, ops.causal_attention(q, k, v))


def test_sink_gradients_and_forward_mode_agree_with_finite_differences():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64)
    pos = torch.arange(5)
    keep = ops.visible(pos, pos, 2)

    def f(q, k, v, sinks):
        return ops.sink_attention(q, k, v, keep, sinks=sinks)

    torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in (q, k, v, sinks)))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v, sinks))
    _, jvp = torch.func.jvp(f, (q, k, v, sinks), tangents)
    _, vjp = torch.func.vjp(f, q, k, v, sinks)
    cotangent = torch.randn_like(jvp)
    # <J t, c> == <t, J^T c>
    torch.testing.assert_close(
        (jvp * cotangent).sum(), sum((t * g).sum() for t, g in zip(tangents, vjp(cotangent)))
    )


def test_generation_with_windows_and_sinks_continues_as_the_model_scores():
    from fmeg.inference import generate

    config = oss_config(num_layers=2, window_size=2)
    params = randomized(gpt.init(config, 1))
    prompt = [[5, 9, 2, 7, 1, 3]]
    out = generate(params, prompt, config, max_new_tokens=6, sampling=ops_greedy())
    tokens = torch.tensor([prompt[0] + out.tokens[0]])
    logits = gpt.apply(params, tokens[:, :-1], config)
    assert logits[0, len(prompt[0]) - 1 :].argmax(-1).tolist() == out.tokens[0]


def ops_greedy():
    from fmeg.inference import SamplingParams

    return SamplingParams(temperature=0.0)


GPT_OSS_FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--normalization",
    "RMSNorm",
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    "7.0",
    "--softmax-type",
    "learnable",
    "--window-size",
    "127,0",
    "--window-attn-skip-freq",
    "2",
    "--enable-gpt-oss",
    "--untie-embeddings-and-output-weights",
]


def test_megatrons_gpt_oss_flags_give_the_model_and_checkpoint_args_give_it_back():

    from fmeg.config.arguments import parse_args
    from fmeg.config.checkpoint_args import model_flags
    from fmeg.config.run_config import model_config
    from fmeg.config.validation import validate

    a = parse_args(GPT_OSS_FLAGS, world_size=1)
    assert validate(a, 1) == []
    saved = model_config(a, 257)
    assert (saved.activation, saved.mlp.glu_linear_offset, saved.mlp.clamp) == (
        "quick_geglu",
        1.0,
        7.0,
    )
    assert (
        saved.attention.softmax_type,
        saved.attention.window_size,
        saved.attention.window_attn_skip_freq,
    ) == ("learnable", 127, 2)
    # Megatron's layers 2 and 4 full
    assert [saved.layer_window(i) for i in range(4)] == [127, None, 127, None]
    assert (
        saved.position,
        saved.rope.kind,
        saved.rope.yarn.factor,
        saved.rope.yarn.original_max_position_embeddings,
        saved.rope.yarn.round_to_int,
    ) == ("rope", "yarn", 32.0, 131072, False)  # as Megatron's --enable-gpt-oss
    b = parse_args(GPT_OSS_FLAGS[:6], world_size=1)
    for name, value in model_flags(saved.flat()).items():
        setattr(b, name, value)
    assert model_config(b, 257) == saved


def test_rope_type_yarn_without_multi_latent_attention_is_named_as_ignored_as_megatron_ignores_it():
    from fmeg.config.arguments import parse_args
    from fmeg.config.megatron_flags import ignored_flags
    from fmeg.config.run_config import model_config
    from fmeg.config.validation import validate

    a = parse_args(["--rope-type", "yarn", "--position-embedding-type", "rope"], world_size=1)
    assert validate(a, 1) == [] and model_config(a, 257).rope.kind == "rope"
    assert any(
        line.startswith(
            "--rope-type yarn: megatron-core reads it with --multi-latent-attention only"
        )
        for line in ignored_flags(a)
    )
