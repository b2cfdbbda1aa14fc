"""Multi-latent attention (fmeg.models.mla) against megatron-core's MLASelfAttention on the same
weights, and its tensor-parallel shards against the whole layer."""

import pytest
import torch

from harness import megatron_mla
from fmeg.models import gpt, self_attention
from harness.parallel import gloo


def mla_config(**overrides) -> gpt.GPTConfig:
    base = dict(
        vocab_size=64,
        max_seq_len=64,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        qk_norm=True,
        multi_latent_attention=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=12,
        qk_pos_emb_head_dim=8,
        v_head_dim=10,
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        mscale=0.707,
        mscale_all_dim=0.707,
        original_max_position_embeddings=16,
        init_std=0.2,
    )
    return gpt.GPTConfig(**{**base, **overrides})


def ours(attn, x, dout, config):
    positions = torch.arange(x.shape[1])
    rope = self_attention.rope_tables(positions, config)
    x = x.clone().requires_grad_()
    leaves = {
        k: {leaf: t.clone().requires_grad_() for leaf, t in sub.items()} for k, sub in attn.items()
    }
    out = self_attention.attention(leaves, x, config, rope)
    out.backward(dout)
    return (
        out.detach(),
        {k: {leaf: t.grad for leaf, t in sub.items()} for k, sub in leaves.items()},
        x.grad,
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"q_lora_rank": None},
        {"qk_norm": False},
        {"rope_type": "rope", "rotary_scaling_factor": 1.0},
        {"mscale_all_dim": 0.0, "v_head_dim": 20},
    ],
    ids=[
        "yarn_q_lora",
        "no_q_lora",
        "no_latent_norms",
        "plain_rope",
        "yarn_without_softmax_mscale",
    ],
)
def test_mla_equals_megatron_cores_mla_self_attention(overrides):
    pytest.importorskip("megatron.core")
    config = mla_config(**overrides)
    attn = gpt.init_layer(config, 3, 0)["attn"]
    gen = torch.Generator().manual_seed(0)
    # longer than the original 16 positions
    x = torch.randn(2, 24, config.hidden_size, generator=gen)
    dout = torch.randn(2, 24, config.hidden_size, generator=gen)
    want_out, want_grads, want_dx = gloo(1).run(
        megatron_mla.megatron_mla, attn, x, dout, config, tp=1
    )[0]
    out, grads, dx = ours(attn, x, dout, config)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, want_dx, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], atol=1e-5, rtol=1e-5, msg=name)
