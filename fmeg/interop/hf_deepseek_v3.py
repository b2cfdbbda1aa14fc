"""Hugging Face transformers' DeepseekV3ForCausalLM <-> fmeg (DeepSeek-V3/R1, Kimi-K2; used by
fmeg.interop.hf).

What maps to what (layer i of L; N heads):
- attention is multi-latent attention (fmeg.models.mla): q_proj or q_a_proj / q_a_layernorm /
q_b_proj as q or
  q_down / q_latent_norm / q_up, kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj as kv_down /
      kv_latent_norm /
  kv_up, o_proj as proj. rope_interleave (DeepSeek's pairs (2i, 2i + 1)) is how megatron-core and
      fmeg rotate MLA's
  rotary part; YaRN from rope_parameters (factor, mscale, mscale_all_dim: the tables' and the
      softmax's scales).
- MLPs: the first first_k_dense_replace layers are dense (gate_proj, up_proj as fc1 [2, F, H]); the
others are
  DeepSeek's mixtures: a sigmoid router (gate.weight) with its expert bias
      (gate.e_score_correction_bias, the
  aux-loss-free balancing), groups (n_group, topk_group), normalised top-k scaled by
      routed_scaling_factor,
  experts stacked as transformers stacks them, and n_shared_experts shared experts as one shared
      MLP.
- multi-token prediction: the checkpoint's layers after the last decoder layer (model.layers.{L +
k}, which
  transformers' model does not load) are fmeg's MTP depths: enorm, hnorm, eh_proj, shared_head.norm
      (the depth's
  final norm) and a decoder layer; their embed_tokens and shared_head.head are the model's own
      embedding and
  output layer, stored again. These live in the safetensors files in DeepSeek's layout (one tensor
      per expert:
  mlp.experts.{e}.gate_proj.weight); mtp_params_from and mtp_files_from read and write that layout.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from fmeg.interop.hf_dir import ImportNotice
from fmeg.interop.hf_yarn import yarn_from_hf, yarn_to_hf
from fmeg.models.config_groups import Experts
from fmeg.models.gpt import GPTConfig
from fmeg.models.moe import expert_ffn, moe_layers

_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_ATTENTION = {
    "q": "q_proj",
    "q_down": "q_a_proj",
    "q_latent_norm": "q_a_layernorm",
    "q_up": "q_b_proj",
    "kv_down": "kv_a_proj_with_mqa",
    "kv_latent_norm": "kv_a_layernorm",
    "kv_up": "kv_b_proj",
    "proj": "o_proj",
}
_MTP = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_norm": "shared_head.norm"}
# transformers' q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon
_LATENT_NORM_EPS = 1e-6


def _unsupported(hf: Any, rope: dict) -> list[str]:
    """What of a DeepseekV3Config fmeg cannot hold, each as a phrase."""
    return [
        why
        for why, bad in (
            (f"hidden_act {hf.hidden_act!r} (only 'silu')", hf.hidden_act != "silu"),
            ("attention_bias=True (biases on the latent projections)", hf.attention_bias),
            ("rope_interleave=False (MLA's rotary pairs are interleaved)", not hf.rope_interleave),
            (
                f"rope_type {rope.get('rope_type')!r} (only 'default' and 'yarn')",
                rope.get("rope_type") not in ("default", "yarn"),
            ),
            (
                "rope_parameters.attention_factor (fmeg derives it from factor, mscale and "
                "mscale_all_dim)",
                rope.get("attention_factor") is not None,
            ),
            (
                "rope_parameters.mscale_all_dim without mscale",
                bool(rope.get("mscale_all_dim")) and not rope.get("mscale"),
            ),
            (
                f"rms_norm_eps {hf.rms_norm_eps} (its latent norms use {_LATENT_NORM_EPS}: fmeg "
                "has one epsilon)",
                hf.rms_norm_eps != _LATENT_NORM_EPS,
            ),
            (
                f"num_key_value_heads {hf.num_key_value_heads} != num_attention_heads (MLA has a "
                "key per head)",
                hf.num_key_value_heads != hf.num_attention_heads,
            ),
            (
                f"n_group {hf.n_group} with {hf.n_routed_experts // max(hf.n_group or 1, 1)} "
                "experts a group (transformers ranks a group by its best two)",
                (hf.n_group or 1) > 1 and hf.n_routed_experts // hf.n_group < 2,
            ),
            ("no shared experts", not hf.n_shared_experts),
            (
                f"first_k_dense_replace {hf.first_k_dense_replace} leaves no mixture-of-experts "
                "layer",
                hf.first_k_dense_replace >= hf.num_hidden_layers,
            ),
        )
        if bad
    ]


def _routing_problems(hf: Any) -> list[str]:
    """config.json's routing fields that contradict one another, in its own names: transformers'
    router splits n_routed_experts into n_group groups, keeps the best topk_group of them and takes
    num_experts_per_tok experts from those (n_group 1: no groups)."""
    e, k, groups, top = hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (e, k, groups))
    if not ints or groups < 1:
        given = f" with topk_group {top}, which would be dropped" if top is not None else ""
        return [f"n_group {groups}{given}: give n_group >= 1 (1: routing without groups)"]
    if not 1 <= k <= e:
        return [f"num_experts_per_tok {k} must be in [1, n_routed_experts {e}]"]
    if groups == 1 and top in (None, 1):
        return []
    if e % groups:
        return [f"n_group {groups} must divide n_routed_experts {e}"]
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= groups:
        return [f"topk_group {top} must be in [1, n_group {groups}]"]
    if k > top * (e // groups):
        return [
            f"num_experts_per_tok {k} exceeds the {top * (e // groups)} experts of topk_group "
            f"{top} groups of {e // groups} (n_routed_experts / n_group)"
        ]
    return []


# GPTConfig's fields as config.json names them, for its checks' messages
_HF_NAMES = {
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_topk": "num_experts_per_tok",
    "num_experts": "n_routed_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "max_seq_len": "max_position_embeddings",
    "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "init_std": "initializer_range",
    "norm_eps": "rms_norm_eps",
}


def _in_hf_names(message: str) -> str:
    """A GPTConfig check's message with config.json's names for its fields."""
    message = message.replace("GPTConfig.", "")
    return re.sub(r"\b(" + "|".join(_HF_NAMES) + r")\b", lambda m: _HF_NAMES[m.group(1)], message)


def config_from(hf: Any, mtp_depths: int = 0) -> GPTConfig:
    """The GPTConfig of a transformers DeepseekV3Config (mtp_depths: how many MTP depths the files
    hold); ValueError naming, in config.json's names, what fmeg cannot hold or what contradicts."""
    rope = dict(hf.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    wrong = _routing_problems(hf)
    if wrong:
        raise ValueError(f"from_hf: DeepSeek-V3 config.json: {wrong[0]}")
    problems = _unsupported(hf, rope)
    if problems:
        raise ValueError(f"from_hf: DeepSeek-V3 {problems[0]} is not supported")
    try:
        return _config(hf, rope, mtp_depths)
    except ValueError as e:
        raise ValueError(f"from_hf: DeepSeek-V3 config.json: {_in_hf_names(str(e))}") from None


def _config(hf: Any, rope: dict, mtp_depths: int) -> GPTConfig:
    yarn = rope.get("rope_type") == "yarn"
    dense = min(hf.first_k_dense_replace, hf.num_hidden_layers)
    return GPTConfig(
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size,
        norm="rmsnorm",
        norm_eps=hf.rms_norm_eps,
        activation="swiglu",
        position="rope",
        tie_embeddings=bool(hf.tie_word_embeddings),
        bias=False,
        init_std=hf.initializer_range,
        qk_norm=True,
        rope_theta=float(rope["rope_theta"]),
        multi_latent_attention=True,
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_head_dim=hf.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        **(yarn_from_hf(rope) if yarn else {}),
        num_experts=hf.n_routed_experts,
        moe_router_topk=hf.num_experts_per_tok,
        moe_ffn_hidden_size=hf.moe_intermediate_size,
        moe_layer_freq=(0,) * dense + (1,) * (hf.num_hidden_layers - dense),
        moe_shared_expert_intermediate_size=hf.n_shared_experts * hf.moe_intermediate_size,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",
        moe_router_num_groups=hf.n_group if (hf.n_group or 1) > 1 else None,
        moe_router_group_topk=hf.topk_group if (hf.n_group or 1) > 1 else None,
        # transformers' rules, which megatron-core's meet only where top-k / topk_group is 2
        moe_router_group_score_topk=2 if (hf.n_group or 1) > 1 else None,
        moe_router_norm_topk=bool(hf.norm_topk_prob),
        moe_router_topk_scaling_factor=None
        if hf.routed_scaling_factor == 1.0
        else float(hf.routed_scaling_factor),
        mtp_num_layers=mtp_depths or None,
    )


def _missing_for_hf(
    c: GPTConfig, pattern: tuple, dense: int, shared: int, groups: int
) -> list[str]:
    """What DeepseekV3ForCausalLM needs that the model lacks, each as a phrase."""
    experts = c.experts or Experts(num_experts=1)
    router = experts.router
    return [
        name
        for name, bad in (
            (
                "RMSNorm, SwiGLU and no biases",
                c.norm != "rmsnorm" or c.activation != "swiglu" or c.bias or c.attention.qkv_bias,
            ),
            ("latent norms (qk_norm)", not c.attention.qk_norm),
            (f"norm_eps {_LATENT_NORM_EPS}", c.norm_eps != _LATENT_NORM_EPS),
            (
                "experts in every layer after the first dense ones",
                not c.experts or pattern != (False,) * dense + (True,) * (c.num_layers - dense),
            ),
            (
                "a sigmoid router with an expert bias",
                router.score_function != "sigmoid" or not router.enable_expert_bias or router.bias,
            ),
            (
                "shared experts a whole number of experts wide, ungated",
                not shared or shared % expert_ffn(c) or experts.shared_expert_gate,
            ),
            (
                "groups ranked by their best two scores",
                groups > 1 and (router.group_score_topk or router.topk // router.group_topk) != 2,
            ),
            (
                "whole rotary heads, YaRN or none, full attention",
                c.rope.percent != 1.0
                or c.rope.scaling is not None
                or c.attention.softmax_type != "vanilla"
                or c.attention.window_size is not None,
            ),
        )
        if bad
    ]


def hf_config(c: GPTConfig) -> Any:
    """transformers' DeepseekV3Config of a DeepSeek-V3-shaped GPTConfig; ValueError naming what it
    cannot hold."""
    from transformers import DeepseekV3Config

    pattern = moe_layers(c) if c.experts else ()
    dense = pattern.index(True) if True in pattern else c.num_layers
    # a dense model: Megatron's defaults, so each missing part is named
    experts = c.experts or Experts(num_experts=1)
    shared = experts.shared_expert_intermediate_size or 0
    groups = experts.router.num_groups or 1
    problems = _missing_for_hf(c, pattern, dense, shared, groups)
    if problems:
        raise ValueError(f"to_hf: DeepseekV3ForCausalLM needs {', '.join(problems)}")
    rope = {"rope_type": "default", "rope_theta": c.rope.theta}
    if c.rope.kind == "yarn":
        rope = yarn_to_hf(c.rope)
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        moe_intermediate_size=expert_ffn(c),
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_heads,
        n_shared_experts=shared // expert_ffn(c),
        n_routed_experts=c.experts.num_experts,
        routed_scaling_factor=c.experts.router.topk_scaling_factor or 1.0,
        kv_lora_rank=c.attention.mla.kv_lora_rank,
        q_lora_rank=c.attention.mla.q_lora_rank,
        qk_rope_head_dim=c.attention.mla.qk_pos_emb_head_dim,
        v_head_dim=c.attention.mla.v_head_dim,
        qk_nope_head_dim=c.attention.mla.qk_head_dim,
        n_group=groups,
        topk_group=c.experts.router.group_topk or 1,
        num_experts_per_tok=c.experts.router.topk,
        first_k_dense_replace=dense,
        norm_topk_prob=c.experts.router.norm_topk,
        max_position_embeddings=c.max_seq_len,
        initializer_range=c.init_std,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=False,
        num_mtp_layers=c.mtp_depth,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def _layer_params(
    s: dict[str, torch.Tensor], hf: str, at: str, moe: bool
) -> dict[str, torch.Tensor]:
    """One decoder layer's fmeg params (under `at`) from transformers' (under `hf`)."""
    out = {f"{at}.{ours}.weight": s[f"{hf}.{theirs}.weight"] for ours, theirs in _NORMS.items()}
    out |= {
        f"{at}.attn.{ours}.weight": s[f"{hf}.self_attn.{theirs}.weight"]
        for ours, theirs in _ATTENTION.items()
        if f"{hf}.self_attn.{theirs}.weight" in s
    }
    mlp = f"{hf}.mlp"
    if not moe:
        out[f"{at}.mlp.fc1.weight"] = torch.stack(
            [s[f"{mlp}.gate_proj.weight"], s[f"{mlp}.up_proj.weight"]]
        )
        out[f"{at}.mlp.fc2.weight"] = s[f"{mlp}.down_proj.weight"]
        return out
    gate_up = s[f"{mlp}.experts.gate_up_proj"]
    e, f2, h = gate_up.shape
    out |= {
        f"{at}.mlp.router.weight": s[f"{mlp}.gate.weight"],
        f"{at}.mlp.router.expert_bias": s[f"{mlp}.gate.e_score_correction_bias"],
        f"{at}.mlp.experts.fc1.weight": gate_up.reshape(e, 2, f2 // 2, h),
        f"{at}.mlp.experts.fc2.weight": s[f"{mlp}.experts.down_proj"],
        f"{at}.mlp.shared.fc1.weight": torch.stack(
            [s[f"{mlp}.shared_experts.gate_proj.weight"], s[f"{mlp}.shared_experts.up_proj.weight"]]
        ),
        f"{at}.mlp.shared.fc2.weight": s[f"{mlp}.shared_experts.down_proj.weight"],
    }
    return out


def _layer_state(
    f: dict[str, torch.Tensor], hf: str, at: str, moe: bool
) -> dict[str, torch.Tensor]:
    """The inverse of _layer_params."""
    s = {f"{hf}.{theirs}.weight": f[f"{at}.{ours}.weight"] for ours, theirs in _NORMS.items()}
    s |= {
        f"{hf}.self_attn.{theirs}.weight": f[f"{at}.attn.{ours}.weight"]
        for ours, theirs in _ATTENTION.items()
        if f"{at}.attn.{ours}.weight" in f
    }
    mlp = f"{hf}.mlp"
    if not moe:
        gate, up = f[f"{at}.mlp.fc1.weight"].unbind(0)
        return s | {
            f"{mlp}.gate_proj.weight": gate.contiguous(),
            f"{mlp}.up_proj.weight": up.contiguous(),
            f"{mlp}.down_proj.weight": f[f"{at}.mlp.fc2.weight"],
        }
    fc1 = f[f"{at}.mlp.experts.fc1.weight"]
    gate, up = f[f"{at}.mlp.shared.fc1.weight"].unbind(0)
    return s | {
        f"{mlp}.gate.weight": f[f"{at}.mlp.router.weight"],
        f"{mlp}.gate.e_score_correction_bias": f[f"{at}.mlp.router.expert_bias"],
        f"{mlp}.experts.gate_up_proj": fc1.reshape(fc1.shape[0], -1, fc1.shape[-1]).contiguous(),
        f"{mlp}.experts.down_proj": f[f"{at}.mlp.experts.fc2.weight"],
        f"{mlp}.shared_experts.gate_proj.weight": gate.contiguous(),
        f"{mlp}.shared_experts.up_proj.weight": up.contiguous(),
        f"{mlp}.shared_experts.down_proj.weight": f[f"{at}.mlp.shared.fc2.weight"],
    }


def params_from(s: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """fmeg's flat params of a DeepseekV3ForCausalLM state dict, with the MTP depths' tensors
    (mtp_params_from's stacked form under model.layers.{L + k}) when the config has depths."""
    out = {
        "embedding.word.weight": s["model.embed_tokens.weight"],
        "final_norm.weight": s["model.norm.weight"],
    }
    pattern = moe_layers(c, mtp=True)
    for i in range(c.num_layers):
        out |= _layer_params(s, f"model.layers.{i}", f"layers.{i}", pattern[i])
    for k in range(c.mtp_depth):
        hf, at = f"model.layers.{c.num_layers + k}", f"mtp.{k}"
        out |= {f"{at}.{ours}.weight": s[f"{hf}.{theirs}.weight"] for ours, theirs in _MTP.items()}
        out |= _layer_params(s, hf, f"{at}.layer", pattern[c.num_layers + k])
    if not c.tie_embeddings:
        out["output.weight"] = s["lm_head.weight"]
    return out


def state_from(f: dict[str, torch.Tensor], c: GPTConfig) -> dict[str, torch.Tensor]:
    """A DeepseekV3ForCausalLM state dict of fmeg's flat params (the MTP depths: mtp_files_from)."""
    s = {
        "model.embed_tokens.weight": f["embedding.word.weight"],
        "model.norm.weight": f["final_norm.weight"],
    }
    pattern = moe_layers(c)
    for i in range(c.num_layers):
        s |= _layer_state(f, f"model.layers.{i}", f"layers.{i}", pattern[i])
    s["lm_head.weight"] = f["embedding.word.weight"] if c.tie_embeddings else f["output.weight"]
    return s


def mtp_prefixes(hf: Any) -> tuple[str, ...]:
    """The checkpoint's name prefixes of the MTP depths a DeepseekV3Config announces
    (num_nextn_predict_layers)."""
    layers, depths = hf.num_hidden_layers, getattr(hf, "num_mtp_layers", 0) or 0
    return tuple(f"model.layers.{layers + k}." for k in range(depths))


_EXPERT = re.compile(
    r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def mtp_params_from(files: dict[str, torch.Tensor], hf: Any) -> tuple[int, dict[str, torch.Tensor]]:
    """(depths, tensors) of the MTP depths read from a checkpoint's files (their names under
    mtp_prefixes): the experts stacked as transformers stacks them, the copies of the embedding and
    output layer left out once checked equal to the model's (fmeg's depths share them). ValueError
    naming what is missing or disagrees."""
    prefixes = mtp_prefixes(hf)
    present = [p for p in prefixes if any(name.startswith(p) for name in files)]
    if 0 < len(present) < len(prefixes):
        raise ValueError(
            f"from_hf: the files hold {len(present)} of the {len(prefixes)} MTP depths "
            "config.json's num_nextn_predict_layers announces; use the config.json that came with "
            "the weights"
        )
    if prefixes and not present:
        # transformers' own save_pretrained writes no MTP depth and keeps the config's (default 1):
        # import the model it holds, and say what is left out
        warnings.warn(
            f"config.json announces {len(prefixes)} MTP depths (num_nextn_predict_layers) and the "
            "files hold none (transformers saves none): imported without multi-token prediction",
            ImportNotice,
            stacklevel=2,
        )
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, t in files.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m["layer"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
        else:
            out[name] = t
    for layer, projections in experts.items():
        stacked = {
            proj: torch.stack([by_e[e] for e in sorted(by_e)]) for proj, by_e in projections.items()
        }
        out[f"{layer}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        out[f"{layer}.down_proj"] = stacked["down_proj"]
    return len(present), out


def check_shared_copies(
    files: dict[str, torch.Tensor], state: dict[str, torch.Tensor], depths: int, layers: int
) -> None:
    """ValueError when a depth's stored embed_tokens or shared_head.head differs from the model's:
    fmeg's MTP depths share the model's embedding and output layer, as DeepSeek-V3's do."""
    for k in range(depths):
        for copy, own in (
            ("embed_tokens.weight", "model.embed_tokens.weight"),
            ("shared_head.head.weight", "lm_head.weight"),
        ):
            name = f"model.layers.{layers + k}.{copy}"
            if name in files and not torch.equal(files[name].float(), state[own].float()):
                raise ValueError(
                    f"from_hf: {name} differs from {own}; fmeg's MTP depths share the model's "
                    "embedding and output layer (DeepSeek-V3 stores copies of them)"
                )


def mtp_files_from(
    f: dict[str, torch.Tensor], c: GPTConfig, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The MTP depths' tensors as DeepSeek-V3's checkpoints hold them (model.layers.{L + k}.*, one
    tensor per expert, with copies of the embedding and output layer); state: the model's own state
    dict (state_from)."""
    out: dict[str, torch.Tensor] = {}
    pattern = moe_layers(c, mtp=True)
    for k in range(c.mtp_depth):
        hf, at = f"model.layers.{c.num_layers + k}", f"mtp.{k}"
        out |= {f"{hf}.{theirs}.weight": f[f"{at}.{ours}.weight"] for ours, theirs in _MTP.items()}
        # a copy of its own per depth
        out[f"{hf}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        out[f"{hf}.shared_head.head.weight"] = state["lm_head.weight"].clone()
        for name, t in _layer_state(f, hf, f"{at}.layer", pattern[c.num_layers + k]).items():
            if name.endswith("experts.gate_up_proj"):
                layer = name[: -len(".gate_up_proj")]
                gate, up = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"{layer}.{e}.gate_proj.weight"] = gate[e].contiguous()
                    out[f"{layer}.{e}.up_proj.weight"] = up[e].contiguous()
            elif name.endswith("experts.down_proj"):
                layer = name[: -len(".down_proj")]
                for e in range(t.shape[0]):
                    out[f"{layer}.{e}.down_proj.weight"] = t[e].contiguous()
            else:
                out[name] = t.contiguous()
    return out
