"""Hugging Face transformers <-> fmeg: GPT2LMHeadModel, LlamaForCausalLM (Llama 2, 3.1 with its rope
scaling, 3.2 with tied embeddings), Qwen2ForCausalLM (Qwen2.5: a bias on q, k and v),
Qwen3ForCausalLM (a norm on each head's queries and keys), and the mixtures of experts
MixtralForCausalLM and Qwen3MoeForCausalLM (experts stacked as transformers 5 stacks them:
gate_up_proj [E, 2F, H], down_proj [E, H, F]) and GptOssForCausalLM (fmeg.interop.hf_gpt_oss), and
DeepseekV3ForCausalLM with its multi-token prediction depths (fmeg.interop.hf_deepseek_v3:
transformers' model does not hold them; read_dir reads them from the files and mtp_files gives them
back in DeepSeek's layout).

    config, params = from_hf(hf_model)
    config, params = read_dir("hf_model/")          # a model directory, MTP depths included
    hf_model = to_hf(params, config)

Both directions are pure renamings and reshapes of tensors (copies, never views of the other side's
storage). transformers is imported lazily: it is a test and interop extra, not a dependency.
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg import tree
from fmeg.interop import hf_deepseek_v3, hf_dir, hf_gpt_oss
from fmeg.models.gpt import GPTConfig, Params, repad_vocab
from fmeg.models.self_attention import fuse_qkv, split_qkv
from fmeg.models.moe import expert_ffn, moe_layers

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def read_dir(input_dir: str) -> tuple[GPTConfig, Params]:
    """from_hf of a transformers model directory (config.json and safetensors; fmeg.interop.hf_dir),
    with the tensors the files hold beyond transformers' model: DeepSeek-V3's MTP depths."""
    model, extra = hf_dir.read_model_dir(input_dir, extra_prefixes=_extra_prefixes)
    return from_hf(model, extra)


def _extra_prefixes(hf_config: Any) -> tuple[str, ...]:
    return hf_deepseek_v3.mtp_prefixes(hf_config) if hf_config.model_type == "deepseek_v3" else ()


def from_hf(
    hf_model: Any, extra: dict[str, torch.Tensor] | None = None
) -> tuple[GPTConfig, Params]:
    """(GPTConfig, params) holding the same function as a transformers causal LM; extra: the
    checkpoint's tensors transformers' model does not hold (DeepSeek-V3's MTP depths, as read_dir
    reads them)."""
    kind = type(hf_model).__name__
    state = {k: v.detach().clone().float() for k, v in hf_model.state_dict().items()}
    if kind == "DeepseekV3ForCausalLM":
        extra = {k: v.detach().clone().float() for k, v in (extra or {}).items()}
        depths, mtp = hf_deepseek_v3.mtp_params_from(extra, hf_model.config)
        config = hf_deepseek_v3.config_from(hf_model.config, depths)
        hf_deepseek_v3.check_shared_copies(extra, state, depths, config.num_layers)
        return config, tree.unflatten(hf_deepseek_v3.params_from(state | mtp, config))
    if kind == "GPT2LMHeadModel":
        config = _gpt2_config(hf_model.config)
        return config, tree.unflatten(_gpt2_params(state, config))
    if kind in _LLAMA_FAMILY:
        config = _llama_config(hf_model.config, kind)
        return config, tree.unflatten(_llama_params(state, config))
    if kind == "GptOssForCausalLM":
        config = hf_gpt_oss.config_from(hf_model.config)
        return config, tree.unflatten(hf_gpt_oss.params_from(state, config))
    raise ValueError(
        f"from_hf: unsupported model {kind}; expected GPT2LMHeadModel, GptOssForCausalLM, "
        f"DeepseekV3ForCausalLM or one of {', '.join(_LLAMA_FAMILY)}"
    )


def to_hf(params: Params, config: GPTConfig) -> Any:
    """A transformers model (GPT2LMHeadModel or LlamaForCausalLM, chosen by the config) with params
    loaded; its vocabulary is the real one (config.vocab_size: the padding rows are dropped)."""
    flat = _export_flat(params, config)
    if config.mtp_depth and config.attention.mla is None:
        raise ValueError(
            "to_hf: of transformers' classes fmeg exports, only DeepseekV3ForCausalLM holds "
            "multi-token prediction depths (a model with --mtp-num-layers exports with MLA)"
        )
    if (
        config.position == "learned"
        and config.norm == "layernorm"
        and config.activation != "swiglu"
    ):
        if config.experts:
            raise ValueError(
                "to_hf: transformers' GPT-2 has no experts; a mixture of experts exports as "
                "Mixtral or Qwen3-MoE, trained with --position-embedding-type rope "
                "--normalization RMSNorm --swiglu --disable-bias-linear"
            )
        if (
            not config.bias
            or config.num_kv_heads != config.num_heads
            or config.attention.kv_channels not in (None, config.hidden_size // config.num_heads)
        ):
            raise ValueError(
                "to_hf: GPT-2 needs bias=True, num_kv_heads == num_heads and head dimension "
                "hidden_size / num_heads"
            )
        model, state = _new_model("GPT2", _gpt2_hf_config(config)), _gpt2_state(flat, config)
    elif config.attention.mla is not None:
        model = _new_model("DeepseekV3", hf_deepseek_v3.hf_config(config))
        state = hf_deepseek_v3.state_from(flat, config)
    elif config.activation == "quick_geglu":
        model, state = (
            _new_model("GptOss", hf_gpt_oss.hf_config(config)),
            hf_gpt_oss.state_from(flat, config),
        )
    elif config.position == "rope" and config.norm == "rmsnorm" and config.activation == "swiglu":
        if config.rope.percent != 1.0:
            raise ValueError(
                f"to_hf: Llama rotates whole heads; got rotary_percent={config.rope.percent}"
            )
        family = _family_of(config)
        model, state = (
            _new_model(family, _llama_hf_config(config, family)),
            _llama_state(flat, config),
        )
    else:
        raise ValueError(
            "to_hf: only GPT-2 style (learned, layernorm, gelu) and Llama style (rope, rmsnorm, "
            f"swiglu) configs have a transformers class; got position={config.position}, "
            f"norm={config.norm}, activation={config.activation}"
        )
    model.load_state_dict(state, strict=True)
    return model.eval()


def mtp_files(params: Params, config: GPTConfig) -> dict[str, torch.Tensor]:
    """The MTP depths' tensors to write beside to_hf's model, in DeepSeek-V3's checkpoint layout
    (none without depths)."""
    if not config.mtp_depth:
        return {}
    # the same refusals as to_hf
    hf_deepseek_v3.hf_config(config)
    flat = _export_flat(params, config)
    return hf_deepseek_v3.mtp_files_from(flat, config, hf_deepseek_v3.state_from(flat, config))


def _export_flat(params: Params, config: GPTConfig) -> dict[str, torch.Tensor]:
    """params flat in fp32, with the real vocabulary and transformers' norm weights (1 + w for
    zero-centred)."""
    params = repad_vocab(params, config, config.vocab_size)
    flat = {k: v.detach().float() for k, v in tree.flatten(params).items()}
    if config.norm_zero_centered:
        flat = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in flat.items()}
    return flat


def _new_model(family: str, hf_config: Any) -> Any:
    import transformers

    cls = getattr(
        transformers, f"{family}LMHeadModel" if family == "GPT2" else f"{family}ForCausalLM"
    )
    if hf_config.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        hf_config.use_sliding_window = False
    with torch.device("cpu"):
        return cls(hf_config).float()


# --- GPT-2
# ------------------------------------------------------------------------------------------ Conv1D
# stores weights [in, out]; q, k and v are three contiguous blocks of c_attn's outputs.


def _gpt2_config(hf: Any) -> GPTConfig:
    act = _GPT2_ACTIVATIONS.get(hf.activation_function)
    if act is None:
        raise ValueError(
            f"from_hf: GPT-2 activation_function {hf.activation_function!r} is not supported"
        )
    if (
        not hf.scale_attn_weights
        or hf.scale_attn_by_inverse_layer_idx
        or hf.reorder_and_upcast_attn
    ):
        raise ValueError(
            "from_hf: GPT-2 attention variants (unscaled, layer-scaled, upcast) are not supported"
        )
    return GPTConfig(
        vocab_size=hf.vocab_size,
        max_seq_len=hf.n_positions,
        num_layers=hf.n_layer,
        hidden_size=hf.n_embd,
        num_heads=hf.n_head,
        ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
        norm="layernorm",
        activation=act,
        position="learned",
        tie_embeddings=bool(hf.tie_word_embeddings),
        bias=True,
        norm_eps=hf.layer_norm_epsilon,
        init_std=hf.initializer_range,
    )


def _gpt2_hf_config(c: GPTConfig) -> Any:
    from transformers import GPT2Config

    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[c.activation]
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.max_seq_len,
        n_layer=c.num_layers,
        n_embd=c.hidden_size,
        n_head=c.num_heads,
        n_inner=c.ffn_hidden_size,
        activation_function=act,
        layer_norm_epsilon=c.norm_eps,
        initializer_range=c.init_std,
        tie_word_embeddings=c.tie_embeddings,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )


def _gpt2_qkv_to_grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    q, k, v = t.chunk(3, dim=0)
    return fuse_qkv(q, k, v, heads)


def _gpt2_params(s: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    out = {
        "embedding.word.weight": s["transformer.wte.weight"],
        "embedding.position.weight": s["transformer.wpe.weight"],
    }
    for i in range(c.num_layers):
        hf, at = f"transformer.h.{i}", f"layers.{i}"
        out |= {
            f"{at}.attn_norm.weight": s[f"{hf}.ln_1.weight"],
            f"{at}.attn_norm.bias": s[f"{hf}.ln_1.bias"],
            f"{at}.attn.qkv.weight": _gpt2_qkv_to_grouped(
                s[f"{hf}.attn.c_attn.weight"].T, c.num_heads
            ),
            f"{at}.attn.qkv.bias": _gpt2_qkv_to_grouped(s[f"{hf}.attn.c_attn.bias"], c.num_heads),
            f"{at}.attn.proj.weight": s[f"{hf}.attn.c_proj.weight"].T.contiguous(),
            f"{at}.attn.proj.bias": s[f"{hf}.attn.c_proj.bias"],
            f"{at}.mlp_norm.weight": s[f"{hf}.ln_2.weight"],
            f"{at}.mlp_norm.bias": s[f"{hf}.ln_2.bias"],
            f"{at}.mlp.fc1.weight": s[f"{hf}.mlp.c_fc.weight"].T.contiguous(),
            f"{at}.mlp.fc1.bias": s[f"{hf}.mlp.c_fc.bias"],
            f"{at}.mlp.fc2.weight": s[f"{hf}.mlp.c_proj.weight"].T.contiguous(),
            f"{at}.mlp.fc2.bias": s[f"{hf}.mlp.c_proj.bias"],
        }
    out |= {
        "final_norm.weight": s["transformer.ln_f.weight"],
        "final_norm.bias": s["transformer.ln_f.bias"],
    }
    if not c.tie_embeddings:
        out["output.weight"] = s["lm_head.weight"]
    return out


def _gpt2_state(f: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    s = {
        "transformer.wte.weight": f["embedding.word.weight"],
        "transformer.wpe.weight": f["embedding.position.weight"],
    }
    for i in range(c.num_layers):
        hf, at = f"transformer.h.{i}", f"layers.{i}"
        qkv_w = torch.cat(split_qkv(f[f"{at}.attn.qkv.weight"], c), dim=0)
        qkv_b = torch.cat(split_qkv(f[f"{at}.attn.qkv.bias"], c), dim=0)
        s |= {
            f"{hf}.ln_1.weight": f[f"{at}.attn_norm.weight"],
            f"{hf}.ln_1.bias": f[f"{at}.attn_norm.bias"],
            f"{hf}.attn.c_attn.weight": qkv_w.T.contiguous(),
            f"{hf}.attn.c_attn.bias": qkv_b,
            f"{hf}.attn.c_proj.weight": f[f"{at}.attn.proj.weight"].T.contiguous(),
            f"{hf}.attn.c_proj.bias": f[f"{at}.attn.proj.bias"],
            f"{hf}.ln_2.weight": f[f"{at}.mlp_norm.weight"],
            f"{hf}.ln_2.bias": f[f"{at}.mlp_norm.bias"],
            f"{hf}.mlp.c_fc.weight": f[f"{at}.mlp.fc1.weight"].T.contiguous(),
            f"{hf}.mlp.c_fc.bias": f[f"{at}.mlp.fc1.bias"],
            f"{hf}.mlp.c_proj.weight": f[f"{at}.mlp.fc2.weight"].T.contiguous(),
            f"{hf}.mlp.c_proj.bias": f[f"{at}.mlp.fc2.bias"],
        }
    s |= {
        "transformer.ln_f.weight": f["final_norm.weight"],
        "transformer.ln_f.bias": f["final_norm.bias"],
    }
    s["lm_head.weight"] = f["embedding.word.weight"] if c.tie_embeddings else f["output.weight"]
    return s


# --- Llama
# ------------------------------------------------------------------------------------------


_LLAMA_FAMILY = {
    "LlamaForCausalLM": "Llama",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "MixtralForCausalLM": "Mixtral",
    "Qwen3MoeForCausalLM": "Qwen3Moe",
}
_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


def _family_of(c: GPTConfig) -> str:
    """The transformers class of a Llama-style config: Qwen3 (qk norm), Qwen2 (bias on q, k, v
    only), Llama, and with experts Qwen3Moe (qk norm) or Mixtral."""
    if c.experts:
        if (
            c.bias
            or c.attention.qkv_bias
            or c.experts.router.bias
            or c.experts.shared_expert_intermediate_size
            or c.experts.router.score_function != "softmax"
            or c.experts.router.num_groups
            or c.experts.router.topk_scaling_factor
        ):
            raise ValueError(
                "to_hf: Mixtral and Qwen3-MoE have softmax routers, no biases, shared experts, "
                "groups or scaling"
            )
        if not c.attention.qk_norm and (
            c.experts.router.pre_softmax or any(not m for m in moe_layers(c))
        ):
            raise ValueError(
                "to_hf: Mixtral renormalises its top-k (no pre-softmax) and every layer is MoE"
            )
        return "Qwen3Moe" if c.attention.qk_norm else "Mixtral"
    if c.attention.qk_norm:
        if c.bias or c.attention.qkv_bias:
            raise ValueError("to_hf: a qk-norm model (Qwen3) has no biases; got bias or qkv_bias")
        return "Qwen3"
    if c.attention.qkv_bias and not c.bias:
        if c.rope.scaling is not None:
            raise ValueError("to_hf: Qwen2 has no llama3 rope scaling")
        return "Qwen2"
    return "Llama"


def _llama_config(hf: Any, kind: str = "LlamaForCausalLM") -> GPTConfig:
    family = _LLAMA_FAMILY[kind]
    rope = getattr(hf, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": hf.rope_theta,
    }
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"from_hf: {family} rope_type {rope_type!r} is not supported (only 'default' and "
            "'llama3')"
        )
    scaling = tuple(rope[k] for k in _SCALING_KEYS) if rope_type == "llama3" else None
    if hf.hidden_act != "silu":
        raise ValueError(
            f"from_hf: {family} hidden_act {hf.hidden_act!r} is not supported (only 'silu')"
        )
    if getattr(hf, "use_sliding_window", False):
        raise ValueError(
            f"from_hf: {family} use_sliding_window=True is not supported (fmeg attends to every "
            "earlier position)"
        )
    attention_bias = bool(getattr(hf, "attention_bias", False))
    if family == "Llama" and attention_bias != hf.mlp_bias:
        raise ValueError("from_hf: Llama attention_bias and mlp_bias must agree")
    if family in ("Qwen3", "Qwen3Moe") and attention_bias:
        raise ValueError(
            "from_hf: Qwen3 attention_bias=True (a bias on attention but not the MLP) is not "
            "supported"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_channels = None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim
    if getattr(hf, "sliding_window", None) and family == "Mixtral":
        raise ValueError(
            "from_hf: Mixtral sliding_window is not supported (fmeg attends to every earlier "
            "position)"
        )
    return GPTConfig(
        **_moe_fields(hf, family),
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        tie_embeddings=bool(hf.tie_word_embeddings),
        bias=family == "Llama" and attention_bias,
        qkv_bias=family == "Qwen2",
        qk_norm=family in ("Qwen3", "Qwen3Moe"),
        rope_scaling=scaling,
        norm_eps=hf.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        init_std=hf.initializer_range,
        kv_channels=kv_channels,
    )


def _moe_fields(hf: Any, family: str) -> dict:
    """GPTConfig's expert fields (and the dense width) of a Mixtral or Qwen3-MoE config; none for
    dense models."""
    if family == "Mixtral":
        return dict(
            ffn_hidden_size=hf.intermediate_size,
            num_experts=hf.num_local_experts,
            moe_router_topk=hf.num_experts_per_tok,
        )
    if family == "Qwen3Moe":
        pattern = tuple(
            int(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0)
            for i in range(hf.num_hidden_layers)
        )
        return dict(
            ffn_hidden_size=hf.intermediate_size,
            num_experts=hf.num_experts,
            moe_router_topk=hf.num_experts_per_tok,
            moe_ffn_hidden_size=hf.moe_intermediate_size,
            moe_layer_freq=pattern,
            moe_router_pre_softmax=not hf.norm_topk_prob,
        )
    return dict(ffn_hidden_size=hf.intermediate_size)


def _llama_hf_config(c: GPTConfig, family: str = "Llama") -> Any:
    import transformers

    rope = {"rope_type": "default", "rope_theta": c.rope.theta}
    if c.rope.scaling is not None:
        rope = {**rope, "rope_type": "llama3", **dict(zip(_SCALING_KEYS, c.rope.scaling))}
    common = dict(
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_seq_len,
        num_hidden_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        intermediate_size=c.ffn_hidden_size,
        hidden_act="silu",
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        initializer_range=c.init_std,
        head_dim=c.head_dim,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "Llama":
        return transformers.LlamaConfig(**common, attention_bias=c.bias, mlp_bias=c.bias)
    if family == "Mixtral":
        return transformers.MixtralConfig(
            **common,
            num_local_experts=c.experts.num_experts,
            sliding_window=None,
            num_experts_per_tok=c.experts.router.topk,
            router_jitter_noise=0.0,
        )
    if family == "Qwen3Moe":
        pattern = moe_layers(c)
        return transformers.Qwen3MoeConfig(
            **{**common, "intermediate_size": c.ffn_hidden_size},
            num_experts=c.experts.num_experts,
            num_experts_per_tok=c.experts.router.topk,
            moe_intermediate_size=expert_ffn(c),
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, m in enumerate(pattern) if not m],
            norm_topk_prob=not c.experts.router.pre_softmax,
            use_sliding_window=False,
            attention_bias=False,
        )
    return getattr(transformers, f"{family}Config")(
        **common,
        use_sliding_window=False,
        **({"attention_bias": False} if family == "Qwen3" else {}),
    )


_LLAMA_LINEARS = {"attn.proj": "self_attn.o_proj", "mlp.fc2": "mlp.down_proj"}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def _llama_params(s: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    out = {
        "embedding.word.weight": s["model.embed_tokens.weight"],
        "final_norm.weight": s["model.norm.weight"],
    }
    kinds = ("weight", "bias") if c.bias else ("weight",)
    for i in range(c.num_layers):
        hf, at = f"model.layers.{i}", f"layers.{i}"
        for ours, theirs in _LLAMA_NORMS.items():
            out[f"{at}.{ours}.weight"] = s[f"{hf}.{theirs}.weight"]
        if c.attention.qk_norm:
            for x in "qk":
                out[f"{at}.attn.{x}_norm.weight"] = s[f"{hf}.self_attn.{x}_norm.weight"]
        if c.attention.qkv_bias and not c.bias:
            out[f"{at}.attn.qkv.bias"] = fuse_qkv(
                *[s[f"{hf}.self_attn.{x}_proj.bias"] for x in "qkv"], c.num_kv_heads
            )
        moe = moe_layers(c)[i]
        if moe:
            e, gate_up = c.experts.num_experts, s[f"{hf}.mlp.experts.gate_up_proj"]
            out[f"{at}.mlp.router.weight"] = s[f"{hf}.mlp.gate.weight"]
            out[f"{at}.mlp.experts.fc1.weight"] = gate_up.reshape(
                e, 2, gate_up.shape[1] // 2, c.hidden_size
            )
            out[f"{at}.mlp.experts.fc2.weight"] = s[f"{hf}.mlp.experts.down_proj"]
        for kind in kinds:
            attn = [s[f"{hf}.self_attn.{x}_proj.{kind}"] for x in "qkv"]
            out[f"{at}.attn.qkv.{kind}"] = fuse_qkv(*attn, c.num_kv_heads)
            for ours, theirs in _LLAMA_LINEARS.items():
                if not (moe and ours.startswith("mlp")):
                    out[f"{at}.{ours}.{kind}"] = s[f"{hf}.{theirs}.{kind}"]
            if not moe:
                out[f"{at}.mlp.fc1.{kind}"] = torch.stack(
                    [s[f"{hf}.mlp.gate_proj.{kind}"], s[f"{hf}.mlp.up_proj.{kind}"]]
                )
    if not c.tie_embeddings:
        out["output.weight"] = s["lm_head.weight"]
    return out


def _llama_state(f: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    s = {
        "model.embed_tokens.weight": f["embedding.word.weight"],
        "model.norm.weight": f["final_norm.weight"],
    }
    kinds = ("weight", "bias") if c.bias else ("weight",)
    for i in range(c.num_layers):
        hf, at = f"model.layers.{i}", f"layers.{i}"
        for ours, theirs in _LLAMA_NORMS.items():
            s[f"{hf}.{theirs}.weight"] = f[f"{at}.{ours}.weight"]
        if c.attention.qk_norm:
            for x in "qk":
                s[f"{hf}.self_attn.{x}_norm.weight"] = f[f"{at}.attn.{x}_norm.weight"]
        if c.attention.qkv_bias and not c.bias:
            for x, t in zip("qkv", split_qkv(f[f"{at}.attn.qkv.bias"], c)):
                s[f"{hf}.self_attn.{x}_proj.bias"] = t.contiguous()
        moe = moe_layers(c)[i]
        if moe:
            fc1 = f[f"{at}.mlp.experts.fc1.weight"]
            s[f"{hf}.mlp.gate.weight"] = f[f"{at}.mlp.router.weight"]
            s[f"{hf}.mlp.experts.gate_up_proj"] = fc1.reshape(
                fc1.shape[0], -1, fc1.shape[-1]
            ).contiguous()
            s[f"{hf}.mlp.experts.down_proj"] = f[f"{at}.mlp.experts.fc2.weight"]
        for kind in kinds:
            for x, t in zip("qkv", split_qkv(f[f"{at}.attn.qkv.{kind}"], c)):
                s[f"{hf}.self_attn.{x}_proj.{kind}"] = t.contiguous()
            if not moe:
                gate, up = f[f"{at}.mlp.fc1.{kind}"].unbind(0)
                s[f"{hf}.mlp.gate_proj.{kind}"], s[f"{hf}.mlp.up_proj.{kind}"] = (
                    gate.contiguous(),
                    up.contiguous(),
                )
            for ours, theirs in _LLAMA_LINEARS.items():
                if not (moe and ours.startswith("mlp")):
                    s[f"{hf}.{theirs}.{kind}"] = f[f"{at}.{ours}.{kind}"]
    s["lm_head.weight"] = f["embedding.word.weight"] if c.tie_embeddings else f["output.weight"]
    return s
