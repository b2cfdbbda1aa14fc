"""The mixture of experts' configuration rules: GPTConfig's experts fields checked, each problem a
need(ok, field, why) naming Megatron's flag (fmeg.models.config_rules collects them)."""

from __future__ import annotations

from fmeg.ops import moe as moe_ops

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
DISPATCHERS = ("allgather", "alltoall")


def validate(config, need) -> None:
    """GPTConfig's MoE fields, each a ValueError naming the field (need(ok, field, why))."""
    e, k = config.experts.num_experts, config.experts.router.topk
    need(e >= 1, "num_experts", f"must be positive, got {e}")
    need(1 <= k <= e, "moe_router_topk", f"must be in [1, num_experts={e}], got {k}")
    freq = config.experts.layer_freq
    if isinstance(freq, int):
        need(freq >= 1, "moe_layer_freq", f"must be positive, got {freq}")
    else:
        need(
            len(freq) == config.num_layers and all(f in (0, 1) for f in freq),
            "moe_layer_freq",
            f"a list must hold one 0 or 1 per layer ({config.num_layers}), got {list(freq)}",
        )
    need(
        config.experts.ffn_hidden_size is None or config.experts.ffn_hidden_size > 0,
        "moe_ffn_hidden_size",
        f"must be positive, got {config.experts.ffn_hidden_size}",
    )
    need(
        config.experts.router.score_function in moe_ops.SCORE_FUNCTIONS,
        "moe_router_score_function",
        f"must be one of {moe_ops.SCORE_FUNCTIONS}, got {config.experts.router.score_function!r}",
    )
    need(
        config.experts.token_dispatcher_type in DISPATCHERS,
        "moe_token_dispatcher_type",
        f"must be one of {DISPATCHERS}, got {config.experts.token_dispatcher_type!r}",
    )
    need(
        config.experts.router.load_balancing_type in LOAD_BALANCING_TYPES,
        "moe_router_load_balancing_type",
        f"must be one of {LOAD_BALANCING_TYPES}, got {config.experts.router.load_balancing_type!r}",
    )
    need(
        config.experts.token_drop_policy in moe_ops.DROP_POLICIES,
        "moe_token_drop_policy",
        f"must be one of {moe_ops.DROP_POLICIES}, got {config.experts.token_drop_policy!r}",
    )
    need(
        config.experts.capacity_factor is None or config.experts.capacity_factor > 0,
        "moe_expert_capacity_factor",
        f"must be positive, got {config.experts.capacity_factor}",
    )
    need(
        not config.experts.pad_expert_input_to_capacity
        or config.experts.capacity_factor is not None,
        "moe_pad_expert_input_to_capacity",
        "needs moe_expert_capacity_factor",
    )
    need(
        config.experts.aux_loss_coeff >= 0,
        "moe_aux_loss_coeff",
        f"must be >= 0, got {config.experts.aux_loss_coeff}",
    )
    validate_router(config, need)


def validate_router(config, need) -> None:
    """GPTConfig's routing fields: group-limited routing and the score function's options."""
    e, k = config.experts.num_experts, config.experts.router.topk
    groups, group_topk = config.experts.router.num_groups, config.experts.router.group_topk
    if groups or group_topk:
        need(
            bool(groups) and bool(group_topk),
            "moe_router_group_topk",
            "group-limited routing needs both moe_router_num_groups and moe_router_group_topk",
        )
        need(e % groups == 0, "moe_router_num_groups", f"{groups} must divide num_experts={e}")
        need(
            group_topk <= groups,
            "moe_router_group_topk",
            f"{group_topk} exceeds moe_router_num_groups={groups}",
        )
        ranked_by = config.experts.router.group_score_topk
        if ranked_by is None:
            need(
                k % group_topk == 0 and k // group_topk <= e // groups,
                "moe_router_group_topk",
                f"moe_router_topk={k} must be a multiple of {group_topk}, with at most "
                f"{e // groups} (experts per group) taken from each group",
            )
        else:
            need(
                1 <= ranked_by <= e // groups,
                "moe_router_group_score_topk",
                f"must be in [1, {e // groups}] (experts per group), got {ranked_by}",
            )
            need(
                k <= group_topk * (e // groups),
                "moe_router_topk",
                f"{k} exceeds the {group_topk * (e // groups)} experts of "
                f"moe_router_group_topk={group_topk} groups",
            )
    need(
        config.experts.router.norm_topk or config.experts.router.score_function == "sigmoid",
        "moe_router_norm_topk",
        "False applies to the sigmoid score function only (softmax weights are normalised by "
        "their softmax)",
    )
    need(
        not config.experts.router.pre_softmax or config.experts.router.score_function == "softmax",
        "moe_router_pre_softmax",
        "applies to the softmax score function only",
    )
    need(
        config.experts.router.dtype in (None, "fp32", "fp64"),
        "moe_router_dtype",
        f"must be fp32 or fp64, got {config.experts.router.dtype!r}",
    )
    need(
        not config.experts.router.enable_expert_bias
        or config.experts.router.score_function == "sigmoid",
        "moe_router_enable_expert_bias",
        "needs the sigmoid score function",
    )
