"""Hugging Face transformers' GptOssForCausalLM <-> fmeg (used by fmeg.interop.hf's from_hf and
to_hf).

What maps to what:
- attention: q, k, v and o projections with biases; `sinks` [N] are the learnable sinks
(softmax_type "learnable");
  sliding_window W attends to W keys, the query's own included: fmeg's (Megatron's) window_size W -
      1; layer_types
  give window_attn_skip_freq, one 0/1 per layer.
- experts: gate_up_proj [E, H, 2F] holds the gate and linear halves interleaved (gate at even
columns), as fc1
  [E, 2, F, H]; down_proj [E, F, H] as fc2 [E, H, F]; their biases; the router's weight and bias.
      The activation
  is the clamped quick-GEGLU: (clamp(up) + 1) * quick_gelu(clamp(gate)), swiglu_limit the clamp.
- YaRN rotary embeddings from rope_parameters (truncate: rounding of the correction range).
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg.interop.hf_yarn import yarn_from_hf, yarn_to_hf
from fmeg.models.gpt import GPTConfig
from fmeg.models.self_attention import fuse_qkv, split_qkv

_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def config_from(hf: Any) -> GPTConfig:
    """The GPTConfig of a transformers GptOssConfig; ValueError naming what fmeg cannot hold."""
    rope = hf.rope_parameters
    if rope.get("rope_type") != "yarn":
        raise ValueError(
            f"from_hf: GPT-OSS rope_type {rope.get('rope_type')!r} is not supported (only 'yarn')"
        )
    if rope.get("attention_factor") is not None:
        raise ValueError(
            "from_hf: GPT-OSS rope_parameters.attention_factor is not supported (fmeg derives it "
            "from factor, mscale and mscale_all_dim)"
        )
    if abs(hf.swiglu_alpha - 1.702) > 1e-9:
        raise ValueError(
            f"from_hf: GPT-OSS swiglu_alpha {hf.swiglu_alpha} is not supported (quick GELU's 1.702)"
        )
    if not hf.attention_bias:
        raise ValueError(
            "from_hf: GPT-OSS attention_bias=False is not supported (its experts are biased)"
        )
    kinds = set(hf.layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"from_hf: GPT-OSS layer_types {sorted(kinds)} are not supported")
    windowed = tuple(int(t == "sliding_attention") for t in hf.layer_types)
    head_dim = hf.head_dim or hf.hidden_size // hf.num_attention_heads
    return GPTConfig(
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        kv_channels=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
        ffn_hidden_size=hf.intermediate_size,
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_func_clamp_value=hf.swiglu_limit,
        position="rope",
        tie_embeddings=bool(hf.tie_word_embeddings),
        bias=True,
        init_std=hf.initializer_range,
        softmax_type="learnable",
        window_size=hf.sliding_window - 1 if any(windowed) else None,
        window_attn_skip_freq=windowed if any(windowed) else None,
        rope_theta=float(rope["rope_theta"]),
        **yarn_from_hf(rope),
        num_experts=hf.num_local_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.intermediate_size,
        moe_router_bias=True,
    )


def hf_config(c: GPTConfig) -> Any:
    """transformers' GptOssConfig of a GPT-OSS-shaped GPTConfig; ValueError naming what it cannot
    hold."""
    from transformers import GptOssConfig

    from fmeg.models.moe import expert_ffn, moe_layers

    problems = [
        name
        for name, bad in (
            ("an MoE MLP in every layer", not c.experts or not all(moe_layers(c))),
            ("learnable sinks", c.attention.softmax_type != "learnable"),
            ("biases with a router bias", not (c.bias and c.experts.router.bias)),
            ("glu_linear_offset 1", c.mlp.glu_linear_offset != 1.0),
            ("a clamp", c.mlp.clamp is None),
            ("YaRN rope", c.rope is None or c.rope.kind != "yarn" or c.rope.scaling is not None),
            (
                "a softmax router renormalising its top-k without extras",
                c.experts.router.score_function != "softmax"
                or c.experts.router.pre_softmax
                or c.experts.shared_expert_intermediate_size
                or c.experts.router.num_groups
                or c.experts.router.topk_scaling_factor
                or c.experts.router.enable_expert_bias,
            ),
            (
                "no qk norm or multi-latent attention",
                c.attention.qk_norm or c.attention.mla is not None,
            ),
        )
        if bad
    ]
    if problems:
        raise ValueError(f"to_hf: GptOssForCausalLM needs {', '.join(problems)}")
    windows = [c.layer_window(i) for i in range(c.num_layers)]
    if len({w for w in windows if w is not None}) > 1:
        raise ValueError("to_hf: GPT-OSS has one sliding window for every windowed layer")
    window = next((w for w in windows if w is not None), None)
    rope = yarn_to_hf(c.rope)
    return GptOssConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=expert_ffn(c),
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_parameters=rope,
        sliding_window=(window + 1) if window is not None else None,
        num_local_experts=c.experts.num_experts,
        layer_types=["sliding_attention" if w is not None else "full_attention" for w in windows],
        num_experts_per_tok=c.experts.router.topk,
        swiglu_limit=c.mlp.clamp,
        tie_word_embeddings=c.tie_embeddings,
        initializer_range=c.init_std,
        attention_bias=True,
        attention_dropout=0.0,
        router_aux_loss_coef=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def params_from(s: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """fmeg's flat params of a GptOssForCausalLM state dict."""
    out = {
        "embedding.word.weight": s["model.embed_tokens.weight"],
        "final_norm.weight": s["model.norm.weight"],
    }
    for i in range(c.num_layers):
        hf, at = f"model.layers.{i}", f"layers.{i}"
        out |= {
            f"{at}.{ours}.weight": s[f"{hf}.{theirs}.weight"] for ours, theirs in _NORMS.items()
        }
        for kind in ("weight", "bias"):
            out[f"{at}.attn.qkv.{kind}"] = fuse_qkv(
                *[s[f"{hf}.self_attn.{x}_proj.{kind}"] for x in "qkv"], c.num_kv_heads
            )
            out[f"{at}.attn.proj.{kind}"] = s[f"{hf}.self_attn.o_proj.{kind}"]
            out[f"{at}.mlp.router.{kind}"] = s[f"{hf}.mlp.router.{kind}"]
        out[f"{at}.attn.sinks"] = s[f"{hf}.self_attn.sinks"]
        gate_up, gate_up_bias = (
            s[f"{hf}.mlp.experts.gate_up_proj"],
            s[f"{hf}.mlp.experts.gate_up_proj_bias"],
        )
        out[f"{at}.mlp.experts.fc1.weight"] = torch.stack(
            [gate_up[..., 0::2], gate_up[..., 1::2]], 1
        ).mT.contiguous()
        out[f"{at}.mlp.experts.fc1.bias"] = torch.stack(
            [gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], 1
        )
        out[f"{at}.mlp.experts.fc2.weight"] = s[f"{hf}.mlp.experts.down_proj"].mT.contiguous()
        out[f"{at}.mlp.experts.fc2.bias"] = s[f"{hf}.mlp.experts.down_proj_bias"]
    if not c.tie_embeddings:
        out["output.weight"] = s["lm_head.weight"]
    return out


def state_from(f: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """A GptOssForCausalLM state dict of fmeg's flat params (the inverse of params_from)."""
    s = {
        "model.embed_tokens.weight": f["embedding.word.weight"],
        "model.norm.weight": f["final_norm.weight"],
    }
    for i in range(c.num_layers):
        hf, at = f"model.layers.{i}", f"layers.{i}"
        s |= {f"{hf}.{theirs}.weight": f[f"{at}.{ours}.weight"] for ours, theirs in _NORMS.items()}
        for kind in ("weight", "bias"):
            for x, t in zip("qkv", split_qkv(f[f"{at}.attn.qkv.{kind}"], c)):
                s[f"{hf}.self_attn.{x}_proj.{kind}"] = t.contiguous()
            s[f"{hf}.self_attn.o_proj.{kind}"] = f[f"{at}.attn.proj.{kind}"]
            s[f"{hf}.mlp.router.{kind}"] = f[f"{at}.mlp.router.{kind}"]
        s[f"{hf}.self_attn.sinks"] = f[f"{at}.attn.sinks"]
        # [E, 2, H, F]
        fc1, fc1_bias = (f[f"{at}.mlp.experts.fc1.weight"].mT, f[f"{at}.mlp.experts.fc1.bias"])
        s[f"{hf}.mlp.experts.gate_up_proj"] = (
            torch.stack([fc1[:, 0], fc1[:, 1]], -1).flatten(-2).contiguous()
        )
        s[f"{hf}.mlp.experts.gate_up_proj_bias"] = torch.stack(
            [fc1_bias[:, 0], fc1_bias[:, 1]], -1
        ).flatten(-2)
        s[f"{hf}.mlp.experts.down_proj"] = f[f"{at}.mlp.experts.fc2.weight"].mT.contiguous()
        s[f"{hf}.mlp.experts.down_proj_bias"] = f[f"{at}.mlp.experts.fc2.bias"]
    s["lm_head.weight"] = f["embedding.word.weight"] if c.tie_embeddings else f["output.weight"]
    return s
