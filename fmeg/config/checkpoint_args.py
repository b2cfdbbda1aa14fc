"""Megatron's --use-checkpoint-args: the model's flags read from the checkpoint --load names, so
that a run continues an imported or earlier model without repeating its architecture.

    # in place, before validation; the flags given still decide the rest
    apply_checkpoint_args(args)
"""

from __future__ import annotations

import argparse
import json

from fmeg import checkpoint
from fmeg.interop import megatron
from fmeg.interop.megatron import model_args
from fmeg.models import gpt
from fmeg.models.saved_config import saved_model
from fmeg.config import mla_flags


_MOE_ARCHITECTURE = (
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_enable_expert_bias",
    "moe_router_group_score_topk",
    "moe_router_norm_topk",
)


def model_flags(model: dict) -> dict:
    """{flag dest: value} that give gpt.GPTConfig fields `model` (the inverse of
    run_config.model_config)."""
    activation = model.get("activation", "gelu")
    flags = {
        "num_layers": model["num_layers"],
        "hidden_size": model["hidden_size"],
        "num_attention_heads": model["num_heads"],
        "ffn_hidden_size": model["ffn_hidden_size"],
        "group_query_attention": model.get("num_kv_heads", model["num_heads"])
        != model["num_heads"],
        "num_query_groups": model.get("num_kv_heads")
        if model.get("num_kv_heads") != model["num_heads"]
        else None,
        "normalization": "RMSNorm" if model.get("norm") == "rmsnorm" else "LayerNorm",
        "swiglu": activation == "swiglu",
        "squared_relu": activation == "squared_relu",
        "openai_gelu": activation == "gelu_tanh",
        "no_bias_gelu_fusion": activation == "gelu",
        "norm_epsilon": model.get("norm_eps", 1e-5),
        "apply_layernorm_1p": model.get("norm_zero_centered", False),
        "rotary_base": model.get("rope_theta", 10000.0),
        "kv_channels": model.get("kv_channels"),
        "rotary_percent": model.get("rotary_percent", 1.0),
        "position_embedding_type": "rope"
        if model.get("position") == "rope"
        else "learned_absolute",
        "untie_embeddings_and_output_weights": not model.get("tie_embeddings", True),
        "disable_bias_linear": not model.get("bias", True),
        "add_qkv_bias": model.get("qkv_bias", False),
        "qk_layernorm": model.get("qk_norm", False),
        "max_position_embeddings": model["max_seq_len"],
        "use_rope_scaling": model.get("rope_scaling") is not None,
        "init_method_std": model.get("init_std", 0.02),
    }
    return flags | _variant_flags(model, activation)


def _variant_flags(model: dict, activation: str) -> dict:
    """model_flags' part for multi-latent attention, the experts, sinks, windows, YaRN, MTP and
    Llama 3.1's RoPE scaling."""
    flags: dict = {}
    if model.get("multi_latent_attention"):
        flags |= {
            name: model[name]
            for name in (
                "multi_latent_attention",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_head_dim",
                "qk_pos_emb_head_dim",
                "v_head_dim",
                "rope_type",
                "rotary_scaling_factor",
                "mscale",
                "mscale_all_dim",
            )
        }
        flags |= {
            dest: model[field] for dest, field in mla_flags.YARN_FLAGS.items() if field in model
        }
        flags["group_query_attention"], flags["num_query_groups"] = False, None
    # the experts' shape and routing; training settings (balance losses, capacity, dispatcher)
    # stay the flags'
    if model.get("num_experts"):
        flags |= {name: model[name] for name in _MOE_ARCHITECTURE if name in model}
        # an imported DeepSeek-V3 routes in fp32, as transformers' does
        if model.get("moe_router_dtype"):
            flags["moe_router_dtype"] = model["moe_router_dtype"]
    flags |= {
        name: model.get(name, default)
        for name, default in (
            ("softmax_type", "vanilla"),
            ("glu_linear_offset", 0.0),
            ("activation_func_clamp_value", None),
            ("window_attn_skip_freq", None),
        )
    }
    flags["quick_geglu"] = activation == "quick_geglu"
    flags["window_size"] = None if model.get("window_size") is None else (model["window_size"], 0)
    if model.get("rope_type") == "yarn" and not model.get("multi_latent_attention"):
        from fmeg.config.gpt_oss_flags import YARN_FLAGS

        # the flag that gives standard attention YaRN, with the model's own values
        flags["enable_gpt_oss"] = True
        flags |= {dest: model[field] for dest, field in YARN_FLAGS.items() if field in model}
    if model.get("mtp_num_layers"):
        flags |= {name: model[name] for name in ("mtp_num_layers", "mtp_loss_scaling_factor")}
    if model.get("rope_scaling") is not None:
        (
            flags["rope_scaling_factor"],
            flags["rope_scaling_low_freq_factor"],
            flags["rope_scaling_high_freq_factor"],
            flags["rope_scaling_original_max_position_embeddings"],
        ) = model["rope_scaling"]
    return flags


def router_without_bias(args: argparse.Namespace) -> str | None:
    """For an MoE checkpoint under --load written before fmeg's routers took --add-bias-linear's
    bias (its model has experts and biases but no moe_router_bias field): mark args so the run keeps
    a router without a bias, and return the warning that says so (None otherwise, or when there is
    nothing readable to look at)."""
    try:
        found = checkpoint.latest(args.load) if args.load else None
        model = json.loads((found / "metadata.json").read_text()).get("model", {}) if found else {}
    except (checkpoint.CheckpointError, OSError, ValueError, AttributeError):
        # loading names the problem, in one line
        return None
    if (
        not isinstance(model, dict)
        or not model.get("num_experts")
        or not model.get("bias", True)
        or "moe_router_bias" in model
    ):
        return None
    args.router_without_bias = True
    return (
        f"--load {args.load}: its routers have no bias (an fmeg before they took "
        "--add-bias-linear's, as megatron-core's have); the run keeps them without one"
    )


def model_from_dests(dests: dict, vocab_size: int) -> gpt.GPTConfig:
    """The model Megatron's model-defining dests give, read as fmeg reads those flags (the other
    flags at their defaults)."""
    from fmeg.config.arguments import parse_args
    from fmeg.config.run_config import model_config

    args = parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1"])
    for dest, value in dests.items():
        setattr(args, dest, value)
    return model_config(args, vocab_size)


def megatron_model(args: argparse.Namespace, vocab_size: int | None = None) -> gpt.GPTConfig:
    """The model a Megatron checkpoint's args (the Namespace in its common.pt) describe; vocab_size
    as fmeg.interop.megatron.model_args.config_from_args takes it."""
    return model_args.config_from_args(args, model_from_dests, vocab_size)


def _megatron_model(found) -> dict:
    """The model fields a Megatron torch_dist iteration's args (its common.pt) describe."""
    try:
        return megatron_model(megatron.saved_args(found)).flat()
    except ValueError as e:
        raise checkpoint.CheckpointError(f"{found / 'common.pt'}: {e}") from None


def _megatron_seq_length(args: argparse.Namespace, found) -> None:
    """Megatron's load_args_from_checkpoint takes seq_length from the checkpoint's args unless
    --seq-length is given (megatron/training/checkpointing.py's _set_arg): do the same, so that a
    run of the checkpoint's positions is not refused for fmeg's default --seq-length."""
    saved = getattr(megatron.saved_args(found), "seq_length", None)
    if "seq_length" in getattr(args, "given", ()) or saved is None:
        return
    if not isinstance(saved, int) or isinstance(saved, bool) or saved <= 0:
        raise checkpoint.CheckpointError(
            f"{found / 'common.pt'}: args.seq_length is {saved!r}, not a positive integer; the "
            "file is damaged (give --seq-length)"
        )
    args.seq_length = saved


def apply_checkpoint_args(args: argparse.Namespace) -> str | None:
    """Set the model's flags from the newest checkpoint under --load; a one-line problem, or
    None."""
    try:
        found = checkpoint.latest(args.load)
    except checkpoint.CheckpointError as e:
        return str(e)
    if found is None:
        return (
            f"--use-checkpoint-args: --load {args.load} holds no checkpoint to read the model from"
        )
    try:
        model = (
            _megatron_model(found)
            if megatron.is_megatron(found)
            else json.loads((found / "metadata.json").read_text())["model"]
        )
        saved_model(model, str(found))
        for dest, value in model_flags(model).items():
            setattr(args, dest, value)
        if megatron.is_megatron(found):
            _megatron_seq_length(args, found)
    except checkpoint.CheckpointError as e:
        return f"--use-checkpoint-args: {e}"
    except (OSError, ValueError, KeyError) as e:
        return f"--use-checkpoint-args: {found}/metadata.json: unreadable ({e})"
    if args.seq_length > args.max_position_embeddings and model.get("position") != "rope":
        args.seq_length = args.max_position_embeddings
    return None
