"""megatron-core's TopKRouter on one CPU rank (the gloo pool's), for comparisons of routing, balance
losses and their gradients with a padding_mask."""

from __future__ import annotations

import torch


def megatron_router(
    mesh,
    weight: torch.Tensor,
    x_SBH: torch.Tensor,
    padding_SB: torch.Tensor | None,
    upstream_SBE: torch.Tensor,
    fields: dict,
) -> dict:
    """megatron-core's router holding weight [E, H], trained on x [s, b, h] with padding_mask [s, b]
    (True: padded): {"probs": [s * b, E], "logged": {name: value}, "weight_grad",
    "tokens_per_expert" (its expert-bias counts)} after backward of (probs * upstream).sum(), its
    balance losses' gradients injected with seed 1."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils, router as router_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    # its router moves its weight to the current CUDA device
    torch.cuda.current_device = lambda: "cpu"
    # its router's matmul names it unset without Transformer Engine
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    logged: dict[str, float] = {}

    # its tracker all-reduces with AVG (not on gloo)
    def save(name, loss, layer_number, num_layers, **_):
        logged[name] = loss.item()

    router_module.save_to_aux_losses_tracker = save
    e, h = weight.shape
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=1,
        num_moe_experts=e,
        use_cpu_initialization=True,
        add_bias_linear=False,
        **fields,
    )
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    router = (
        router_module.TopKRouter(config=config, pg_collection=get_default_pg_collection())
        .float()
        .train()
    )
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(weight)
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    probs, _ = router(x_SBH.contiguous(), padding_mask=padding_SB.contiguous())
    (probs * upstream_SBE.contiguous().reshape(probs.shape)).sum().backward()
    counts = getattr(router, "local_tokens_per_expert", None)
    return {
        "probs": probs.detach(),
        "logged": logged,
        "weight_grad": router.weight.grad.clone(),
        "tokens_per_expert": None if counts is None else counts.clone(),
    }
