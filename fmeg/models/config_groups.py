"""The groups of GPTConfig's tree: one per variant of attention, positions, the MLP and what follows
the decoder. A dense GPT-2 has none of the optional ones (rope, experts, MLA, MTP are None), so the
dense path never reads them.

    GPTConfig(..., experts=Experts(num_experts=8, router=Router(topk=2)), rope=RoPE(theta=5e5))

Each group is frozen, plain data (JSON-able through GPTConfig.flat()), and checked where its rules
live: the experts' in fmeg.models.moe, MLA's in fmeg.models.mla, the rest in gpt_config.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-latent attention (fmeg.models.mla), named as Megatron's flags."""

    # None: queries straight from the hidden states
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128


@dataclass(frozen=True)
class Attention:
    """Attention's options besides its heads: the head dimension, norms and biases on q and k,
    sinks, sliding windows, dropout, and multi-latent attention instead of GQA."""

    # the head dimension (Megatron's --kv-channels); None: hidden_size / num_heads
    kv_channels: int | None = None
    # Megatron's --qk-layernorm (Qwen3): the norm on each head's queries and keys
    qk_norm: bool = False
    # Megatron's --add-qkv-bias (Qwen2.5): a bias on q, k and v when the config has bias=False
    qkv_bias: bool = False
    dropout: float = 0.0
    # "off-by-one": a sink logit 0 in every softmax; "learnable": one per head
    softmax_type: str = "vanilla"
    # sliding-window attention: each query sees itself and this many keys before it
    window_size: int | None = None
    # every N-th layer full attention, or 1/0 per layer
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    mla: MLA | None = None


@dataclass(frozen=True)
class YaRN:
    """YaRN's rotary frequencies (megatron-core's names in comments where they differ); MLA's
    softmax scale reads factor and mscale_all_dim too."""

    # rotary_scaling_factor
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # megatron-core's correction_range_round_to_int (GPT-OSS's YaRN: False)
    round_to_int: bool = True


@dataclass(frozen=True)
class RoPE:
    """Rotary positions: their base, the fraction of each head they rotate, and Llama 3.1's or
    YaRN's frequencies (kind "yarn"; megatron-core's MLA reads yarn's factor and mscale_all_dim
    for its softmax scale whatever the kind, so they are kept either way)."""

    theta: float = 10000.0
    # the fraction of each head's dimensions that RoPE rotates (the first ones)
    percent: float = 1.0
    # Llama 3.1's (factor, low, high, original)
    scaling: tuple[float, float, float, int] | None = None
    # Megatron's --rope-type: rope or yarn
    kind: str = "rope"
    yarn: YaRN = field(default_factory=YaRN)


@dataclass(frozen=True)
class MLP:
    """The gated MLPs' extras (GPT-OSS's): act(gate) * (linear + offset), the gate clamped above
    at clamp and the linear half to [-clamp, clamp]."""

    glu_linear_offset: float = 0.0
    # Megatron's --activation-func-clamp-value
    clamp: float | None = None


@dataclass(frozen=True)
class Router:
    """How tokens choose their experts (fmeg.models.moe), named as Megatron's --moe-router-*."""

    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None
    # how many of a group's best scores rank it (None: megatron-core's topk // group_topk; 2:
    # transformers' DeepSeek-V3), and whether a sigmoid router's top-k weights are divided by
    # their sum (transformers' norm_topk_prob; megatron-core always divides): imported models keep
    # their own rules, and --use-checkpoint-args carries them
    group_score_topk: int | None = None
    norm_topk: bool = True
    # "fp32" or "fp64": the router's matmul in that dtype
    dtype: str | None = None
    load_balancing_type: str = "aux_loss"
    # DeepSeek-V3's aux-loss-free balancing (sigmoid routers)
    enable_expert_bias: bool = False
    # a bias on the router's logits: megatron-core's router with --add-bias-linear
    bias: bool = False
    bias_update_rate: float = 1e-3
    # Megatron's benchmarking switch: random router logits
    force_load_balancing: bool = False


@dataclass(frozen=True)
class Experts:
    """Mixture of experts in place of the dense MLP (fmeg.models.moe), named as Megatron's
    --moe-* flags."""

    num_experts: int
    # None: the dense ffn_hidden_size
    ffn_hidden_size: int | None = None
    # every N-th layer is MoE, or one 0/1 per layer
    layer_freq: int | tuple[int, ...] = 1
    router: Router = field(default_factory=Router)
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    # None: dropless
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    pad_expert_input_to_capacity: bool = False
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    # how tokens reach their experts' ranks (the same numbers)
    token_dispatcher_type: str = "allgather"


@dataclass(frozen=True)
class MTP:
    """DeepSeek-V3's multi-token prediction (fmeg.models.mtp): num_layers extra layers after the
    decoder, on the last pipeline stage, their mean loss weighted by loss_scaling_factor."""

    num_layers: int
    loss_scaling_factor: float = 0.1
