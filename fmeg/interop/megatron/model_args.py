"""A Megatron checkpoint's `args` (the Namespace in its common.pt) as fmeg's model, and fmeg's model
as those args.

    # what --use-checkpoint-args does in Megatron-LM
    config = config_from_args(common["args"])
    # what an exported checkpoint's common.pt holds
    args = args_for(config, tp=2, iteration=100, ...)

Megatron's Namespace holds its flags by their dest names (num_layers, add_bias_linear, ...).
config_from_args starts from fmeg's defaults, takes each model-defining dest the checkpoint holds,
and builds the model as the flags would (through the function fmeg.training passes in): one reading
of Megatron's flags. args_for writes the same dests back, so that config_from_args(args_for(config))
== config.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from fmeg.data.tokenizers import padded_vocab_size
from fmeg.models.config_groups import RoPE
from fmeg.models import gpt

# the dests that fix the model's function, under the names Megatron's Namespace gives them
MODEL_DESTS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "max_position_embeddings",
    "seq_length",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "swiglu",
    "squared_relu",
    "openai_gelu",
    "untie_embeddings_and_output_weights",
    "qk_layernorm",
    "add_qkv_bias",
    "use_rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "init_method_std",
    "hidden_dropout",
    "attention_dropout",
    "make_vocab_size_divisible_by",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
)
# nargs="+" in Megatron: one value per layer kind
_LISTS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff")
# The kind of value Megatron's parser writes for each dest that is not a number: a switch's True or
# False, or a choice, a layer pattern or a list (not checked here; reading the model names a bad
# one).
_SWITCHES = frozenset(
    {
        "apply_layernorm_1p",
        "swiglu",
        "squared_relu",
        "openai_gelu",
        "untie_embeddings_and_output_weights",
        "qk_layernorm",
        "add_qkv_bias",
        "use_rope_scaling",
        "moe_router_pre_softmax",
        "moe_pad_expert_input_to_capacity",
        "moe_shared_expert_gate",
        "moe_router_enable_expert_bias",
    }
)
_UNCHECKED = frozenset(
    {
        "position_embedding_type",
        "normalization",
        "moe_layer_freq",
        "moe_router_score_function",
        "moe_router_dtype",
        "moe_token_drop_policy",
        *_LISTS,
    }
)

# A function that builds fmeg's model from Megatron's model-defining dests (fmeg's own reading of
# the flags, which the layer above interop owns) and the vocabulary size.
ModelFromDests = Callable[[dict[str, Any], int], gpt.GPTConfig]


def damaged_dest(args: Any) -> str | None:
    """The first model-defining dest whose value is not of the kind Megatron's parser gives it (a
    str where it writes a number, say), as a phrase; None when all are."""
    for dest in MODEL_DESTS:
        value = getattr(args, dest, None)
        if value is None or dest in _UNCHECKED:
            continue
        switch = dest in _SWITCHES
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (not switch and not number) or (switch and not isinstance(value, bool)):
            kind = "True or False" if switch else "a number"
            return (
                f"args.{dest} is the {type(value).__name__} {value!r:.40} where Megatron writes "
                f"{kind}"
            )
    return None


def config_from_args(
    args: Any, model_from_dests: ModelFromDests, vocab_size: int | None = None
) -> gpt.GPTConfig:
    """The model a Megatron checkpoint's args describe, built by model_from_dests (fmeg's reading of
    the flags: fmeg.config.checkpoint_args.megatron_model passes it). vocab_size: the tokenizer's;
    None takes the args' vocab_size (NullTokenizer runs record it), else its padded_vocab_size
    (every row an id)."""
    damaged = damaged_dest(args)
    if damaged:
        raise ValueError(f"{damaged}: the checkpoint's args are damaged")
    dests = {}
    for dest in MODEL_DESTS:
        value = getattr(args, dest, None)
        if value is not None:
            listed = dest in _LISTS and not isinstance(value, (list, tuple))
            dests[dest] = [value] if listed else value
    if not getattr(args, "group_query_attention", False):
        dests["num_query_groups"] = None
    dests["disable_bias_linear"] = not getattr(args, "add_bias_linear", True)
    dests["no_bias_gelu_fusion"] = not getattr(args, "bias_gelu_fusion", True)
    heads, kv_channels = dests.get("num_attention_heads"), dests.get("kv_channels")
    if kv_channels and heads and kv_channels * heads == dests.get("hidden_size"):
        # Megatron records the default head size; fmeg leaves it implied
        dests["kv_channels"] = None
    dests["padded_vocab_size"] = getattr(args, "padded_vocab_size", None)
    vocab = vocab_size or getattr(args, "vocab_size", None) or dests["padded_vocab_size"]
    if not vocab or not dests.get("num_layers"):
        raise ValueError("the Megatron checkpoint's args name no vocabulary size or no layers")
    return model_from_dests(dests, vocab)


def _moe_args(c: gpt.GPTConfig) -> dict[str, Any]:
    """Megatron's MoE dests for the model's experts (none for a dense model)."""
    bias = c.bias
    # megatron-core's router has a bias exactly with add_bias_linear
    if c.experts and c.experts.router.bias != bias:
        raise ValueError(
            f"the model's router {'has' if c.experts.router.bias else 'has no'} bias, while its "
            "other "
            f"layers {'have' if bias else 'have no'} biases; megatron-core has no such model (an "
            "MoE checkpoint of an fmeg before routers took --add-bias-linear's bias: train on "
            "without it or with --disable-bias-linear)"
        )
    if c.experts is None:
        return {}
    router = c.experts.router
    group_rule = router.group_score_topk not in (None, router.topk // (router.group_topk or 1))
    if group_rule or not router.norm_topk and router.topk > 1:
        raise ValueError(
            "the model routes by transformers' DeepSeek-V3 rules (groups ranked by their best "
            f"{router.group_score_topk}, top-k weights normalised: "
            f"{router.norm_topk}), which megatron-core's router does not compute; export "
            "it with export-hf"
        )
    return dict(
        num_experts=c.experts.num_experts,
        moe_ffn_hidden_size=c.experts.ffn_hidden_size or c.ffn_hidden_size,
        moe_layer_freq=c.experts.layer_freq,
        moe_router_topk=router.topk,
        moe_router_score_function=router.score_function,
        moe_router_pre_softmax=router.pre_softmax,
        moe_router_topk_scaling_factor=router.topk_scaling_factor,
        moe_router_num_groups=router.num_groups,
        moe_router_group_topk=router.group_topk,
        moe_router_dtype=router.dtype,
        moe_router_load_balancing_type=[router.load_balancing_type],
        moe_aux_loss_coeff=[c.experts.aux_loss_coeff],
        moe_z_loss_coeff=c.experts.z_loss_coeff,
        moe_expert_capacity_factor=c.experts.capacity_factor,
        moe_token_drop_policy=c.experts.token_drop_policy,
        moe_pad_expert_input_to_capacity=c.experts.pad_expert_input_to_capacity,
        moe_shared_expert_intermediate_size=c.experts.shared_expert_intermediate_size,
        moe_shared_expert_gate=c.experts.shared_expert_gate,
        moe_router_enable_expert_bias=router.enable_expert_bias,
        moe_router_bias_update_rate=router.bias_update_rate,
    )


def args_for(
    config: gpt.GPTConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    make_vocab_size_divisible_by: int = 128,
    iteration: int = 0,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    params_dtype: torch.dtype = torch.float32,
) -> argparse.Namespace:
    """Megatron-LM's args for fmeg's model trained to `iteration`, to be resumed at tp / pp / ep
    (its vocabulary padded as Megatron pads it for that tp)."""
    c = config
    gelu_tanh, bias = c.activation == "gelu_tanh", c.bias
    moe = _moe_args(c)
    # a model with learned positions: Megatron's args still hold RoPE's (defaults, unused)
    rope = c.rope or RoPE()
    scaling = rope.scaling or (None, None, None, None)
    return argparse.Namespace(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        group_query_attention=c.num_kv_heads != c.num_heads,
        num_query_groups=c.num_kv_heads,
        ffn_hidden_size=c.ffn_hidden_size,
        kv_channels=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        seq_length=c.max_seq_len,
        position_embedding_type="rope" if c.position == "rope" else "learned_absolute",
        add_position_embedding=c.position != "rope",
        rotary_base=rope.theta,
        rotary_percent=rope.percent,
        normalization="RMSNorm" if c.norm == "rmsnorm" else "LayerNorm",
        norm_epsilon=c.norm_eps,
        apply_layernorm_1p=c.norm_zero_centered,
        swiglu=c.activation == "swiglu",
        squared_relu=c.activation == "squared_relu",
        openai_gelu=gelu_tanh and not bias,
        bias_gelu_fusion=gelu_tanh and bias,
        add_bias_linear=bias,
        add_qkv_bias=bias or c.attention.qkv_bias,
        untie_embeddings_and_output_weights=not c.tie_embeddings,
        qk_layernorm=c.attention.qk_norm,
        use_rope_scaling=rope.scaling is not None,
        rope_scaling_factor=scaling[0],
        rope_scaling_low_freq_factor=scaling[1],
        rope_scaling_high_freq_factor=scaling[2],
        rope_scaling_original_max_position_embeddings=scaling[3],
        init_method_std=c.init_std,
        hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention.dropout,
        vocab_size=c.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab_size=padded_vocab_size(c.vocab_size, tp, make_vocab_size_divisible_by),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        iteration=iteration,
        consumed_train_samples=consumed_train_samples,
        consumed_valid_samples=consumed_valid_samples,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        ckpt_format="torch_dist",
        **moe,
    )
