"""The runner's FLOP count is Megatron's formula, and that formula counts exactly the matmuls that
run."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fmeg.models import gpt
from fmeg.training.report import model_flops


def step_flops(loss, config, batch_size: int = 2, seq: int = 8) -> int:
    """torch's FLOP counter over one training step (forward and backward) of loss(params, batch,
    config), attention by SDPA's math backend (its matmuls are ops the counter knows; CPU flash
    attention is not among them)."""
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        torch.func.grad(loss)(gpt.init(config, 0), batch, config)
    return counter.get_total_flops()


def test_gpt2_shapes_reduce_to_the_72_b_s_l_h2_form():
    c = gpt.GPTConfig.gpt2(
        vocab_size=50257,
        padded_vocab_size=50304,
        num_layers=24,
        hidden_size=2048,
        num_heads=16,
        max_seq_len=2048,
    )
    b, s, L, h, V = 4, 2048, 24, 2048, 50304
    assert model_flops(c, b, s) == pytest.approx(
        72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    )


@given(
    style=st.sampled_from(["gpt2", "llama"]),
    groups=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
    seq=st.sampled_from([8, 16]),
    padding=st.integers(0, 40),
)
def test_megatrons_formula_counts_every_matmul_of_a_training_step(
    style, groups, layers, seq, padding
):
    """GQA, SwiGLU, tied or untied: the formula equals torch's FLOP counter over forward + backward
    of the loss (attention counted in full, as the formula does; the output layer over the padded
    vocabulary, as Megatron computes it, so the count here uses padded logits)."""
    c = getattr(gpt.GPTConfig, style)(
        vocab_size=37,
        max_seq_len=16,
        num_layers=layers,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=groups if style == "llama" else None,
    )
    c = c.replace(vocab_size=37 + padding, padded_vocab_size=37 + padding)  # every row a real logit
    assert step_flops(gpt.loss, c, seq=seq) == pytest.approx(model_flops(c, 2, seq), rel=1e-12)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_the_mla_terms_count_every_multi_latent_attention_matmul(q_lora_rank):
    """Multi-latent attention (with and without a query latent, values narrower than queries):
    torch's FLOP counter over a training step equals the formula."""
    c = gpt.GPTConfig.llama(
        vocab_size=40,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=20,
        multi_latent_attention=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_head_dim=12,
        qk_pos_emb_head_dim=8,
        v_head_dim=10,
        qk_norm=True,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        mscale_all_dim=1.0,
    )
    counted = step_flops(gpt.loss, c)
    assert counted == pytest.approx(model_flops(c, 2, 8), rel=1e-12)


@pytest.mark.parametrize("shared", [None, 12])
def test_megatrons_moe_terms_count_every_expert_matmul(shared):
    """With experts (a dense first layer, top-2 of 4, SwiGLU, a shared expert), torch's FLOP counter
    over a training step equals Megatron's formula plus the router's matmuls, which the formula
    leaves out (the expert width is odd so that experts take the per-expert matmuls, which the
    counter counts, not torch._grouped_mm)."""
    c = gpt.GPTConfig.llama(
        vocab_size=40,
        max_seq_len=16,
        num_layers=3,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=20,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=5,
        moe_layer_freq=(0, 1, 1),
        moe_shared_expert_intermediate_size=shared,
    )
    counted = step_flops(gpt.loss, c)
    router = (
        3 * 2 * (2 * 8) * c.hidden_size * c.experts.num_experts * 2
    )  # forward + backward, 2 MoE layers
    assert counted == pytest.approx(model_flops(c, 2, 8) + router, rel=1e-12)


def test_the_activation_estimate_is_korthikantis_and_grows_with_the_experts_a_token_visits():
    import dataclasses

    from fmeg.training.report import activation_units, memory_estimate

    # Megatron's default: the scores are held
    gpt2 = gpt.GPTConfig.gpt2(
        vocab_size=64,
        max_seq_len=32,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        attention_dropout=0.1,
    )
    assert activation_units(gpt2) == 34
    est = memory_estimate(
        0, 0, gpt2, micro_batch=2, seq_len=32, tp=2, pp=1, in_flight=1, activation_bytes=2
    )
    assert est["activations"] == 2 * (32 * 2 * 32 * (34 + 5 * 4 * 32 / 32) / 2)
    moe = lambda **kw: dataclasses.replace(gpt2, num_experts=8, moe_ffn_hidden_size=32, **kw)
    top1, top2 = activation_units(moe(moe_router_topk=1)), activation_units(moe(moe_router_topk=2))
    assert top1 == 15 + 3 + (2 + 4) and top2 == 15 + 3 + 2 * (2 + 4)
    half = activation_units(moe(moe_router_topk=2, moe_layer_freq=(0, 1)))
    assert half == (34 + top2) / 2


def test_context_parallelism_divides_the_activation_estimate():
    from fmeg.training.report import memory_estimate

    c = gpt.GPTConfig.gpt2(vocab_size=64, max_seq_len=64, num_layers=2, hidden_size=32, num_heads=4)
    one, four = (memory_estimate(10, 0, c, 1, 64, 1, 1, 1, cp=cp) for cp in (1, 4))
    assert (
        four["activations"] == one["activations"] / 4
        and four["weights_and_grads"] == one["weights_and_grads"]
    )


def test_megatrons_mtp_terms_count_the_depths_projections_and_output_layers():
    """Multi-token prediction: torch's FLOP counter over a training step of the objective equals
    Megatron's formula, less its norms' per-token terms (3h per depth, not matmuls), plus the
    depths' transformer layers, which Megatron's formula leaves out (each counted as one more
    decoder layer)."""
    from fmeg.models import mtp

    c = gpt.GPTConfig.llama(
        vocab_size=40,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=20,
        mtp_num_layers=2,
    )
    counted = step_flops(mtp.loss, c)
    plain = c.replace(mtp_num_layers=None)
    layer = model_flops(plain.replace(num_layers=3), 2, 8) - model_flops(plain, 2, 8)
    norms = 6 * 2 * 8 * 2 * 3 * c.hidden_size
    assert counted == pytest.approx(model_flops(c, 2, 8) - norms + 2 * layer, rel=1e-12)


def test_the_activation_estimate_counts_multi_latent_attentions_tensors_and_the_mtp_depths():
    """MLA keeps q, k of N (dq + dr), v and the projection's input of N dv, and each latent twice
    (its norm's input and its up-projection's) where standard attention keeps 4h + 2h + 2h; each MTP
    depth adds one layer and the 8h of its norms' and eh_proj's inputs on the last stage."""
    import dataclasses

    from fmeg.training.report import activation_units, memory_estimate

    c = gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=32,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=128,
        multi_latent_attention=True,
        q_lora_rank=16,
        kv_lora_rank=32,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=16,
    )
    mlp = 3 + 4 * 128 / 64 * 1.5
    assert activation_units(c) == 7 + (4 * (32 + 16) + 4 * 4 * 16 + 4 * 4 * 16) / 64 + mlp
    assert activation_units(c.replace(q_lora_rank=None)) == activation_units(c) - 4 * 16 / 64
    plain = c.replace(multi_latent_attention=False)
    assert activation_units(plain) == 15 + mlp
    one = memory_estimate(
        0, 0, c, micro_batch=2, seq_len=32, tp=1, pp=1, in_flight=1, activation_bytes=2
    )
    layer = one["activations"] / 2
    two = memory_estimate(
        0,
        0,
        dataclasses.replace(c, mtp_num_layers=2),
        micro_batch=2,
        seq_len=32,
        tp=1,
        pp=1,
        in_flight=1,
        activation_bytes=2,
    )
    assert two["activations"] == pytest.approx(one["activations"] + 2 * (layer + 8 * 32 * 2 * 64))


def test_the_attention_scores_count_only_where_training_holds_them():
    """Korthikanti's 5 a s / h term is the [b, heads, s, s] scores: fmeg holds them under attention
    dropout (explicit probabilities) and with sinks or a window; SDPA's fused kernels keep none. At
    seq 4096 and cp 4 without dropout the estimate overstated a run's activations several times
    before."""
    from fmeg.training.report import activation_units, holds_attention_scores, memory_estimate

    c = gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=4096,
        num_layers=4,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=256,
    )
    dropped = c.replace(attention_dropout=0.1)
    assert not holds_attention_scores(c) and holds_attention_scores(dropped)
    assert holds_attention_scores(c.replace(softmax_type="learnable"))
    assert holds_attention_scores(c.replace(window_size=128))
    fused, explicit = (
        memory_estimate(0, 0, m, 1, 4096, 1, 1, 1, cp=4)["activations"] for m in (c, dropped)
    )
    s, b, h, a = 4096, 1, 128, 4
    assert fused == s * b * h * activation_units(c) / 4 * 2 * 4  # 4 layers, fp32 (2 x 16-bit)
    assert explicit == fused + s * b * h * (5 * a * s / h) / 4 * 2 * 4


def test_the_start_line_says_what_the_memory_estimate_counts(tmp_path):
    from harness.runner import run_recipe

    _, stdout = run_recipe(
        tmp_path,
        "plain",
        1,
        ["--train-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0"],
        common=[
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--global-batch-size",
            "2",
            "--micro-batch-size",
            "1",
        ],
    )
    line = next(line for line in stdout.splitlines() if line.startswith("theoretical memory"))
    assert line.endswith(
        "(activations of 1 microbatch in flight, without attention scores, Korthikanti's count)"
    )
