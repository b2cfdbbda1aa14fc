"""The rules a GPTConfig must meet, each a ValueError naming the flat field (need): the shape,
positions, attention's variants, the gated MLP's extras and MTP here; the experts' in
fmeg.models.moe and multi-latent attention's in fmeg.models.mla."""

from __future__ import annotations

from typing import Any

from fmeg.models import mla, moe_rules
from fmeg.ops.activations import GATES

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "squared_relu", "quick_geglu")
# fc1 gives [2, F]: gate and linear halves
GATED = tuple(GATES)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
POSITIONS = ("learned", "rope")


def need(ok: bool, field: str, why: str) -> None:
    """A ValueError naming the field and why, unless ok."""
    if not ok:
        raise ValueError(f"GPTConfig.{field}: {why}")


def validate(c: Any) -> None:
    _validate_shape(c)
    _validate_variants(c)


def _validate_shape(c: Any) -> None:
    """The sizes, the norm, the activation and the head dimension."""
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
    kv_channels = c.attention.kv_channels
    need(
        kv_channels is not None or c.hidden_size % c.num_heads == 0,
        "hidden_size",
        f"{c.hidden_size} must be divisible by num_heads={c.num_heads} (or give kv_channels)",
    )
    need(
        kv_channels is None or kv_channels > 0,
        "kv_channels",
        f"must be positive, got {kv_channels}",
    )
    need(
        c.num_heads % c.num_kv_heads == 0,
        "num_kv_heads",
        f"{c.num_kv_heads} must divide num_heads={c.num_heads}",
    )
    need(c.norm_eps > 0, "norm_eps", f"must be positive, got {c.norm_eps}")
    need(c.init_std > 0, "init_std", f"must be positive, got {c.init_std}")
    need(
        0.0 <= c.hidden_dropout < 1.0,
        "hidden_dropout",
        f"must be in [0, 1), got {c.hidden_dropout}",
    )


def _validate_rope(c: Any) -> None:
    """RoPE's fraction, Llama 3.1's scaling and YaRN's factor."""
    rope = c.rope
    need(0.0 < rope.percent <= 1.0, "rotary_percent", f"must be in (0, 1], got {rope.percent}")
    need(
        c.rotary_dim > 0 and c.rotary_dim % 2 == 0,
        "position",
        f"rope needs an even, positive rotated dimension, got head dimension {c.head_dim} x "
        f"rotary_percent {rope.percent} = {c.rotary_dim}",
    )
    scaling = rope.scaling
    need(
        scaling is None
        or (
            len(scaling) == 4 and scaling[0] > 0 and scaling[2] > scaling[1] > 0 and scaling[3] > 0
        ),
        "rope_scaling",
        f"must be (factor > 0, low > 0, high > low, original positions > 0), got {scaling}",
    )
    need(rope.kind in ("rope", "yarn"), "rope_type", f"must be rope or yarn, got {rope.kind!r}")
    factor = rope.yarn.factor
    need(factor > 0, "rotary_scaling_factor", f"must be positive, got {factor}")


def _validate_attention(c: Any) -> None:
    """Dropout, sinks, sliding windows and multi-latent attention."""
    a = c.attention
    need(0.0 <= a.dropout < 1.0, "attention_dropout", f"must be in [0, 1), got {a.dropout}")
    need(
        a.softmax_type in SOFTMAX_TYPES,
        "softmax_type",
        f"must be one of {SOFTMAX_TYPES}, got {a.softmax_type!r}",
    )
    need(
        a.window_size is None or a.window_size >= 0,
        "window_size",
        f"must be >= 0, got {a.window_size}",
    )
    freq = a.window_attn_skip_freq
    need(
        freq is None
        or (
            freq > 0 if isinstance(freq, int) else len(freq) == c.num_layers and set(freq) <= {0, 1}
        ),
        "window_attn_skip_freq",
        f"must be a positive int or one 0/1 per layer ({c.num_layers}), got {freq}",
    )
    if a.mla is not None:
        need(
            a.softmax_type == "vanilla" and a.window_size is None,
            "softmax_type",
            "sinks and sliding windows are for standard attention, not multi-latent attention",
        )
        mla.validate(c, need)


def _validate_variants(c: Any) -> None:
    """Positions, attention's variants, the gated MLP's extras, MTP and the experts."""
    if c.rope is not None:
        _validate_rope(c)
    _validate_attention(c)
    clamp = c.mlp.clamp
    need(
        clamp is None or clamp > 0, "activation_func_clamp_value", f"must be positive, got {clamp}"
    )
    need(
        c.activation in GATED or (c.mlp.glu_linear_offset == 0.0 and clamp is None),
        "glu_linear_offset",
        f"the offset and clamp act on gated MLPs ({GATED}), not {c.activation}",
    )
    if c.mtp is not None:
        depth = c.mtp.num_layers
        need(depth > 0, "mtp_num_layers", f"must be positive, got {depth}")
        need(
            c.rope is not None,
            "mtp_num_layers",
            "multi-token prediction needs rope positions (its layers would need the first stage's "
            "learned position table)",
        )
    if c.experts is not None:
        moe_rules.validate(c, need)
