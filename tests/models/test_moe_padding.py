"""Megatron's padding_mask for experts (--sft's padded tokens): padded tokens are routed, but the
balance losses, the z-loss and the expert-bias counts leave them out, as megatron-core's router
does, and per-token losses seed each balance loss with its microbatch's unpadded tokens."""

import pytest
import torch

from fmeg.models import gpt, moe
from harness.parallel import gloo
from harness.moe_steps import assert_per_token_step_has_the_gradient_of, batch_for, moe_config


@pytest.mark.parametrize(
    "fields",
    [
        {
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": 0.1,
            "moe_z_loss_coeff": 0.01,
        },
        {
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_aux_loss_coeff": 0.1,
            "moe_z_loss_coeff": 0.01,
            "moe_router_score_function": "sigmoid",
        },
    ],
    ids=["aux_loss", "seq_aux_loss_sigmoid"],
)
def test_a_padding_mask_leaves_padded_tokens_out_of_the_balance_losses_as_megatron_core(fields):
    """megatron-core's padding_mask: padded tokens are routed, but their scores and choices leave
    the balance losses, whose token counts are the unpadded ones', and the z-loss averages the
    unpadded tokens: the same values and router gradients (1e-6) on the same weights. The
    expert-bias counts skip them too (megatron-core 0.16's own count fails on a padding mask: it
    does not broadcast it over the experts; here against its definition)."""
    pytest.importorskip("megatron.core")
    from harness import megatron_router

    b, s, h, e, k = 3, 8, 16, 4, 2
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(e, h, generator=gen), torch.randn(b, s, h, generator=gen)
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[0, 5:], padding[2, 2:] = True, True  # rows padded at their ends, unevenly
    upstream = torch.randn(b, s, e, generator=gen)
    want = gloo(1).run(
        megatron_router.megatron_router,
        weight,
        x.transpose(0, 1),
        padding.T,
        upstream.transpose(0, 1),
        {"moe_router_topk": k, **fields},
    )[0]
    config = moe_config(
        hidden_size=h,
        num_experts=e,
        moe_router_topk=k,
        **{n: v for n, v in fields.items() if n.startswith("moe_")},
    )

    def objective(w):
        logits = moe.router_logits({"router": {"weight": w}}, x, config)
        probs, experts = moe.route_tokens(logits, config)
        dense = torch.zeros(b, s, e).scatter(2, experts, probs)
        losses = moe.balance_losses(logits, config, valid_BS=moe.valid_tokens(padding))
        coeffs = {
            "load_balancing_loss": config.experts.aux_loss_coeff,
            "z_loss": config.experts.z_loss_coeff,
        }
        total = (dense * upstream).sum() + sum(coeffs[n] * v for n, v in losses.items())
        return total, {n: v.detach() for n, v in losses.items()}

    grad, values = torch.func.grad(objective, has_aux=True)(weight)
    name = (
        "seq_load_balancing_loss"
        if fields["moe_router_load_balancing_type"] == "seq_aux_loss"
        else "load_balancing_loss"
    )
    assert values["load_balancing_loss"].item() == pytest.approx(want["logged"][name], rel=1e-6)
    assert values["z_loss"].item() == pytest.approx(want["logged"]["z_loss"], rel=1e-6)
    torch.testing.assert_close(grad, want["weight_grad"], rtol=1e-5, atol=1e-7)
    sigmoid = config.replace(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    aux = moe.AuxLosses(counts=torch.zeros(1, e), padding=padding)
    p = {
        "router": {"weight": weight, "expert_bias": torch.zeros(e)},
        "experts": gpt.init(sigmoid, 0)["layers"][1]["mlp"]["experts"],
    }
    gpt.mlp(p, x, sigmoid, aux=aux, index=0)
    _, experts = moe.route_tokens(
        moe.router_logits(p, x, sigmoid), sigmoid, p["router"]["expert_bias"]
    )
    want_counts = torch.bincount(experts[~padding].reshape(-1), minlength=e).float()
    assert torch.equal(aux.counts[0], want_counts) and want_counts.sum() == k * (~padding).sum()


def test_per_token_loss_with_padding_seeds_each_balance_loss_with_its_unpadded_tokens():
    """--calculate-per-token-loss with a padding_mask (--sft's): megatron-core's router scales its
    balance losses by the tokens it counted, the unpadded ones, so the objective is (sum of the
    token losses + sum over microbatches of unpadded tokens x balance losses over them) / loss
    tokens."""
    config = moe_config(moe_z_loss_coeff=1e-2)
    params = gpt.init(config, 0)
    microbatches = []
    for seed, cut in ((0, 6), (1, 3)):
        mb = batch_for(config, seed=seed)
        padding = torch.zeros(mb["tokens"].shape, dtype=torch.bool)
        padding[1, cut:] = True
        microbatches.append({**mb, "loss_mask": (~padding).float(), "padding_mask": padding})
    assert_per_token_step_has_the_gradient_of(
        params, microbatches, config, lambda mb: (~mb["padding_mask"]).sum()
    )
