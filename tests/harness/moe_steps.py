"""A small mixture-of-experts configuration, its batches, and the check that a per-token step
has the gradient of its objective."""

import torch
from fmeg import tree
from fmeg.models import gpt, moe
from fmeg.ops import moe as moe_ops


def moe_config(**overrides):
    base = dict(
        vocab_size=48,
        max_seq_len=16,
        num_layers=3,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=16,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_layer_freq=(0, 1, 1),
        moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=0.01,
    )
    return gpt.GPTConfig.llama(**{**base, **overrides})


def batch_for(config, b=2, s=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def lm_and_balance(params, batch, config):
    """(the LM loss, every layer's coefficient-weighted balance losses summed), each MoE layer a
    loop over experts (its balance losses leaving out the batch's padding_mask, when it has one)."""
    extra = []
    valid = moe.valid_tokens(batch.get("padding_mask"))

    def loop_moe(p, x, config, tp, *, activation, aux, index, recompute=frozenset()):
        b, s, h = x.shape
        logits = moe.router_logits(p, x, config)
        probs, experts = moe.route_tokens(logits, config)
        losses = moe.balance_losses(logits, config, valid_BS=valid)
        extra.append(
            sum(
                {
                    "load_balancing_loss": config.experts.aux_loss_coeff,
                    "z_loss": config.experts.z_loss_coeff or 0.0,
                }[n]
                * v
                for n, v in losses.items()
            )
        )
        fc1, fc2 = p["experts"]["fc1"], p["experts"]["fc2"]
        y = moe_ops.reference_moe(
            x.reshape(-1, h),
            probs.reshape(b * s, -1),
            experts.reshape(b * s, -1),
            fc1["weight"],
            fc2["weight"],
            activation,
            fc1.get("bias"),
            fc2.get("bias"),
        ).reshape(b, s, h)
        return y + moe.shared_expert(p, x, config, tp, activation) if "shared" in p else y

    original = moe.moe_mlp
    moe.moe_mlp = loop_moe
    try:
        lm = gpt.loss(params, batch, config)
    finally:
        moe.moe_mlp = original
    return lm, sum(extra)


def assert_per_token_step_has_the_gradient_of(params, microbatches, config, balance_tokens):
    """The runner's per-token step's gradient (returned) equals that of (sum of the token losses +
    sum over microbatches of balance_tokens(mb) x its balance losses) / loss tokens."""
    from fmeg.parallel.mesh import Mesh
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings

    tokens = sum(gpt.loss_tokens(mb) for mb in microbatches)

    def objective(p):
        total = 0.0
        for mb in microbatches:
            lm, balance = lm_and_balance(p, mb, config)
            total = total + gpt.loss_tokens(mb) * lm + balance_tokens(mb) * balance
        return total / tokens

    want = torch.func.grad(objective)(params)
    mesh, layout = Mesh.single(), Layout()
    state = init_state(shard_params(params, config, layout, mesh), config, layout, mesh)
    train_iteration(
        state,
        microbatches,
        config=config,
        layout=layout,
        mesh=mesh,
        settings=StepSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, per_token=True),
    )
    got = state.flat.views(state.main_grad())[0]
    for path, grad in tree.items(got):
        torch.testing.assert_close(grad, tree.flatten(want)[path], rtol=1e-4, atol=1e-6, msg=path)
    return got
