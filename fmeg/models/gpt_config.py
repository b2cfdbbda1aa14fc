"""GPTConfig: a GPT's shape and options, named as Megatron's flags where it has them, checked when
made.

    config = GPTConfig(vocab_size=..., max_seq_len=..., num_layers=..., hidden_size=...,
        num_heads=...)
    config = GPTConfig.llama(num_layers=4)          # presets, overridden by keyword
    config.replace(num_layers=8)                    # a copy with changes

Every field is plain data (JSON-able: checkpoints store it); a field that makes no sense raises
ValueError naming it. The model itself is fmeg.models.gpt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fmeg.models import mla, moe
from fmeg.ops.activations import GATES

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "squared_relu", "quick_geglu")
GATED = tuple(GATES)  # fc1 gives [2, F]: gate and linear halves
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int  # the tokenizer's vocabulary: logits and losses cover these ids
    max_seq_len: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int | None = None  # None: num_heads (multi-head attention)
    # None: 4 * hidden; swiglu: Megatron's int(8 * hidden / 3 / 64) * 64
    ffn_hidden_size: int | None = None
    norm: str = "layernorm"
    activation: str = "gelu"
    position: str = "learned"
    tie_embeddings: bool = True
    bias: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # rows of the embedding and output tables; None: vocab_size
    padded_vocab_size: int | None = None
    # Megatron's --apply-layernorm-1p: norm weights w start at 0, scale by 1 + w
    norm_zero_centered: bool = False
    # the head dimension (Megatron's --kv-channels); None: hidden_size / num_heads
    kv_channels: int | None = None
    # the fraction of each head's dimensions that RoPE rotates (the first ones)
    rotary_percent: float = 1.0
    # Megatron's --qk-layernorm (Qwen3): the norm on each head's queries and keys
    qk_norm: bool = False
    # Megatron's --add-qkv-bias (Qwen2.5): a bias on q, k and v when bias=False
    qkv_bias: bool = False
    # Llama 3.1's (factor, low, high, original)
    rope_scaling: tuple[float, float, float, int] | None = None
    # Mixture of experts (fmeg.models.moe), named as Megatron's flags; None experts: every MLP is
    # dense
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_layer_freq: int | tuple[int, ...] = 1  # every N-th layer is MoE, or one 0/1 per layer
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # how many of a group's best scores rank it (None: megatron-core's topk // group_topk; 2:
    # transformers' DeepSeek-V3), and whether a sigmoid router's top-k weights are divided by their
    # sum (transformers' norm_topk_prob; megatron-core always divides): imported models keep their
    # own rules, and --use-checkpoint-args carries them (fmeg.config.moe_flags: hidden flags, no
    # Megatron one)
    moe_router_group_score_topk: int | None = None
    moe_router_norm_topk: bool = True
    moe_router_dtype: str | None = None  # "fp32" or "fp64": the router's matmul in that dtype
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    # DeepSeek-V3's aux-loss-free balancing (sigmoid routers)
    moe_router_enable_expert_bias: bool = False
    # a bias on the router's logits: megatron-core's router with --add-bias-linear
    moe_router_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # how tokens reach their experts' ranks (the same numbers)
    moe_token_dispatcher_type: str = "allgather"
    # Megatron's benchmarking switch: random router logits
    moe_router_force_load_balancing: bool = False
    # Multi-latent attention (fmeg.models.mla), named as Megatron's flags
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries straight from the hidden states
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN rotary embeddings (rope_type "yarn"; MLA's softmax scale reads the factor and
    # mscale_all_dim too)
    rope_type: str = "rope"
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # megatron-core's correction_range_round_to_int (GPT-OSS's YaRN: False)
    yarn_round_to_int: bool = True
    # GPT-OSS's attention and MLP, named as Megatron's flags
    # "off-by-one": a sink logit 0 in every softmax; "learnable": one per head
    softmax_type: str = "vanilla"
    # sliding-window attention: each query sees itself and this many keys before it
    window_size: int | None = None
    # every N-th layer full attention, or 1/0 per layer
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    glu_linear_offset: float = 0.0  # gated MLPs: act(gate) * (linear + offset)
    # gated MLPs: gate clamped above, linear half to [-c, c]
    activation_func_clamp_value: float | None = None
    # Multi-token prediction (fmeg.models.mtp): D extra layers after the decoder, on the last
    # pipeline stage
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        for name in ("rope_scaling", "moe_layer_freq", "window_attn_skip_freq"):
            if isinstance(getattr(self, name), list):  # as JSON metadata gives it back
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            ffn = 4 * self.hidden_size
            # Megatron rounds down (64 where that would leave nothing)
            if self.activation == "swiglu":
                ffn = max(64, 8 * self.hidden_size // 192 * 64)
            object.__setattr__(self, "ffn_hidden_size", ffn)
        _validate(self)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (Megatron: kv_channels *
        rotary_percent; MLA: its rotary part, qk_pos_emb_head_dim)."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.head_dim * self.rotary_percent)

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window, or None for full attention: every layer's with an int
        skip frequency N but each N-th (Megatron counts layers from 1), or as the 1/0 list says
        (layers past it, multi-token prediction's, attend fully)."""
        freq = self.window_attn_skip_freq
        if self.window_size is None:
            return None
        if freq is None:
            return self.window_size
        if isinstance(freq, int):
            return self.window_size if (index + 1) % freq else None
        return self.window_size if index < len(freq) and freq[index] else None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with changes; an unpadded vocabulary stays unpadded when vocab_size changes."""
        if "vocab_size" in changes and self.padded_vocab_size == self.vocab_size:
            changes.setdefault("padded_vocab_size", None)
        return dataclasses.replace(self, **changes)

    @classmethod
    def gpt2(cls, **overrides: Any) -> "GPTConfig":
        """GPT-2 small (124M) unless overridden: learned positions, LayerNorm, tanh GELU, tied,
        biased."""
        base = dict(
            vocab_size=50257,
            max_seq_len=1024,
            num_layers=12,
            hidden_size=768,
            num_heads=12,
            norm="layernorm",
            activation="gelu_tanh",
            position="learned",
            tie_embeddings=True,
            bias=True,
            norm_eps=1e-5,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def llama(cls, **overrides: Any) -> "GPTConfig":
        """A Llama-style model (RoPE, RMSNorm, SwiGLU, no biases, untied) of about 1.3B by
        default."""
        base = dict(
            vocab_size=32000,
            max_seq_len=2048,
            num_layers=24,
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=8,
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            tie_embeddings=False,
            bias=False,
            norm_eps=1e-6,
            rope_theta=10000.0,
        )
        return cls(**{**base, **overrides})


def need(ok: bool, field: str, why: str) -> None:
    """A ValueError naming the field and why, unless ok."""
    if not ok:
        raise ValueError(f"GPTConfig.{field}: {why}")


def _validate(c: GPTConfig) -> None:
    _validate_shape(c)
    _validate_variants(c)


def _validate_shape(c: GPTConfig) -> None:
    """The sizes, the norm, the activation and the positions."""
    for name in (
        "vocab_size",
        "max_seq_len",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "ffn_hidden_size",
    ):
        need(getattr(c, name) > 0, name, f"must be positive, got {getattr(c, name)}")
    need(
        c.padded_vocab_size >= c.vocab_size,
        "padded_vocab_size",
        f"{c.padded_vocab_size} is smaller than vocab_size={c.vocab_size}",
    )
    need(c.norm in NORMS, "norm", f"must be one of {NORMS}, got {c.norm!r}")
    need(
        c.activation in ACTIVATIONS,
        "activation",
        f"must be one of {ACTIVATIONS}, got {c.activation!r}",
    )
    need(c.position in POSITIONS, "position", f"must be one of {POSITIONS}, got {c.position!r}")
    need(
        c.kv_channels is not None or c.hidden_size % c.num_heads == 0,
        "hidden_size",
        f"{c.hidden_size} must be divisible by num_heads={c.num_heads} (or give kv_channels)",
    )
    need(
        c.kv_channels is None or c.kv_channels > 0,
        "kv_channels",
        f"must be positive, got {c.kv_channels}",
    )
    need(
        0.0 < c.rotary_percent <= 1.0,
        "rotary_percent",
        f"must be in (0, 1], got {c.rotary_percent}",
    )
    need(
        c.num_heads % c.num_kv_heads == 0,
        "num_kv_heads",
        f"{c.num_kv_heads} must divide num_heads={c.num_heads}",
    )
    need(
        c.position != "rope" or (c.rotary_dim > 0 and c.rotary_dim % 2 == 0),
        "position",
        f"rope needs an even, positive rotated dimension, got head dimension {c.head_dim} x "
        f"rotary_percent {c.rotary_percent} = {c.rotary_dim}",
    )
    need(c.norm_eps > 0, "norm_eps", f"must be positive, got {c.norm_eps}")
    need(c.init_std > 0, "init_std", f"must be positive, got {c.init_std}")


def _validate_variants(c: GPTConfig) -> None:
    """RoPE's scaling, dropout, attention's variants, multi-latent attention, MTP and the
    experts."""
    need(
        c.rope_scaling is None
        or (
            len(c.rope_scaling) == 4
            and c.rope_scaling[0] > 0
            and c.rope_scaling[2] > c.rope_scaling[1] > 0
            and c.rope_scaling[3] > 0
        ),
        "rope_scaling",
        f"must be (factor > 0, low > 0, high > low, original positions > 0), got {c.rope_scaling}",
    )
    need(
        0.0 <= c.hidden_dropout < 1.0,
        "hidden_dropout",
        f"must be in [0, 1), got {c.hidden_dropout}",
    )
    need(
        0.0 <= c.attention_dropout < 1.0,
        "attention_dropout",
        f"must be in [0, 1), got {c.attention_dropout}",
    )
    need(c.rope_type in ("rope", "yarn"), "rope_type", f"must be rope or yarn, got {c.rope_type!r}")
    need(
        c.rotary_scaling_factor > 0,
        "rotary_scaling_factor",
        f"must be positive, got {c.rotary_scaling_factor}",
    )
    need(
        c.softmax_type in SOFTMAX_TYPES,
        "softmax_type",
        f"must be one of {SOFTMAX_TYPES}, got {c.softmax_type!r}",
    )
    need(
        c.window_size is None or c.window_size >= 0,
        "window_size",
        f"must be >= 0, got {c.window_size}",
    )
    freq = c.window_attn_skip_freq
    need(
        freq is None
        or (
            freq > 0 if isinstance(freq, int) else len(freq) == c.num_layers and set(freq) <= {0, 1}
        ),
        "window_attn_skip_freq",
        f"must be a positive int or one 0/1 per layer ({c.num_layers}), got {freq}",
    )
    need(
        c.activation_func_clamp_value is None or c.activation_func_clamp_value > 0,
        "activation_func_clamp_value",
        f"must be positive, got {c.activation_func_clamp_value}",
    )
    need(
        c.activation in GATED
        or (c.glu_linear_offset == 0.0 and c.activation_func_clamp_value is None),
        "glu_linear_offset",
        f"the offset and clamp act on gated MLPs ({GATED}), not {c.activation}",
    )
    need(
        not c.multi_latent_attention or (c.softmax_type == "vanilla" and c.window_size is None),
        "softmax_type",
        "sinks and sliding windows are for standard attention, not multi-latent attention",
    )
    if c.multi_latent_attention:
        mla.validate(c, need)
    if c.mtp_num_layers is not None:
        need(c.mtp_num_layers > 0, "mtp_num_layers", f"must be positive, got {c.mtp_num_layers}")
        need(
            c.position == "rope",
            "mtp_num_layers",
            "multi-token prediction needs rope positions (its layers would need the first stage's "
            "learned position table)",
        )
    if c.num_experts is not None:
        moe.validate(c, need)
