"""Megatron's GPT-OSS flags (megatron/training/arguments.py: --softmax-type, --window-size,
--window-attn-skip-freq, --quick-geglu, --glu-linear-offset, --activation-func-clamp-value;
megatron/post_training's --enable-gpt-oss): their parser group, the GPTConfig fields they set, and
their rules.

--enable-gpt-oss sets YaRN rotary embeddings (whatever --position-embedding-type says, as Megatron's
model builder does) with the values that builder gives them: factor 32, original context 131072,
beta_fast 32, beta_slow 1, mscale 1 and 0, the correction range not rounded. (Hugging Face's gpt-oss
checkpoints say original context 4096.) The --yarn-* flags (Megatron-Bridge's names) override those
values (with --multi-latent-attention, the original context, betas and rounding of MLA's YaRN:
fmeg.config.mla_flags); --use-checkpoint-args sets them from an imported checkpoint.
"""

from __future__ import annotations

import argparse

from fmeg.config.declare import flag, group, switch
from fmeg.config.moe_flags import layer_freq

GPT_OSS_YARN = dict(
    position="rope",
    rope_type="yarn",
    rotary_scaling_factor=32.0,
    original_max_position_embeddings=131072,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.0,
    yarn_round_to_int=False,
)
# {flag dest: the GPTConfig field it overrides}
YARN_FLAGS = {
    "yarn_rotary_scaling_factor": "rotary_scaling_factor",
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_mscale": "mscale",
    "yarn_mscale_all_dim": "mscale_all_dim",
    "yarn_correction_range_round_to_int": "yarn_round_to_int",
}


def window(text: str) -> tuple[int, int]:
    """--window-size: "left,right" (Megatron's tuple form, brackets allowed), or one number for
    left."""
    parts = [p for p in text.strip().strip("()[]").split(",") if p.strip()]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) not in (1, 2):
        raise argparse.ArgumentTypeError(f"not a window such as 128,0: {text!r}")
    return values if len(values) == 2 else (values[0], 0)


def _yarn(field: str) -> str:
    return f"with --enable-gpt-oss: YaRN's {field} (default {GPT_OSS_YARN[field]})"


def _true(text: str) -> bool:
    return text.lower() == "true"


@group("GPT-OSS attention and MLP")
class GPTOSSFlags:
    """Attention sinks, sliding windows, the clamped GLU and GPT-OSS's YaRN."""

    softmax_type: str = flag(
        "--softmax-type",
        choices=["vanilla", "off-by-one", "learnable"],
        default="vanilla",
        help="attention sinks: off-by-one adds a logit 0 to every softmax, learnable one logit per "
        "head",
    )
    window_size: tuple[int, int] | None = flag(
        "--window-size",
        type=window,
        help="sliding-window attention: LEFT,0, each query sees itself and LEFT keys before it",
    )
    window_attn_skip_freq: int | tuple[int, ...] | None = flag(
        "--window-attn-skip-freq",
        type=layer_freq,
        help="N: every N-th layer attends fully; or a 0/1 pattern per layer (1: windowed)",
    )
    quick_geglu: bool = switch(
        "--quick-geglu", help="gated MLP with quick GELU, x * sigmoid(1.702 x)"
    )
    glu_linear_offset: float = flag(
        "--glu-linear-offset",
        type=float,
        default=0.0,
        help="gated MLPs: act(gate) * (linear + offset)",
    )
    activation_func_clamp_value: float | None = flag(
        "--activation-func-clamp-value",
        type=float,
        help="gated MLPs: the gate clamped above at C, the linear half to [-C, C]",
    )
    enable_gpt_oss: bool = switch(
        "--enable-gpt-oss",
        help="YaRN rotary embeddings with GPT-OSS's values, as Megatron's model builder sets them",
    )
    yarn_rotary_scaling_factor: float | None = flag(
        "--yarn-rotary-scaling-factor", type=float, help=_yarn("rotary_scaling_factor")
    )
    yarn_original_max_position_embeddings: int | None = flag(
        "--yarn-original-max-position-embeddings",
        type=int,
        help=_yarn("original_max_position_embeddings"),
    )
    yarn_beta_fast: float | None = flag("--yarn-beta-fast", type=float, help=_yarn("beta_fast"))
    yarn_beta_slow: float | None = flag("--yarn-beta-slow", type=float, help=_yarn("beta_slow"))
    yarn_mscale: float | None = flag("--yarn-mscale", type=float, help=_yarn("mscale"))
    yarn_mscale_all_dim: float | None = flag(
        "--yarn-mscale-all-dim", type=float, help=_yarn("mscale_all_dim")
    )
    # no Megatron flag: --use-checkpoint-args sets it
    yarn_correction_range_round_to_int: bool | None = flag(
        "--yarn-correction-range-round-to-int", type=_true, help=argparse.SUPPRESS
    )


def model_fields(a: argparse.Namespace) -> dict:
    """The GPTConfig fields of these flags (the activation itself: megatron_flags.activation)."""
    fields = dict(
        softmax_type=a.softmax_type,
        glu_linear_offset=a.glu_linear_offset,
        activation_func_clamp_value=a.activation_func_clamp_value,
    )
    if a.window_size is not None:
        fields |= dict(window_size=a.window_size[0], window_attn_skip_freq=a.window_attn_skip_freq)
    if not a.enable_gpt_oss:
        return fields
    given = {
        field: getattr(a, dest)
        for dest, field in YARN_FLAGS.items()
        if getattr(a, dest) is not None
    }
    return fields | GPT_OSS_YARN | given


def problems(a: argparse.Namespace) -> list[str]:
    """One line for each GPT-OSS flag that cannot run."""
    out = []
    gated = a.swiglu or a.quick_geglu
    if a.quick_geglu and (a.swiglu or a.squared_relu):
        out.append("--quick-geglu, --swiglu and --squared-relu are alternatives; choose one")
    if not gated and (a.glu_linear_offset != 0.0 or a.activation_func_clamp_value is not None):
        out.append(
            "--glu-linear-offset and --activation-func-clamp-value act on gated MLPs: add "
            "--quick-geglu (GPT-OSS's) or --swiglu, or drop them"
        )
    if a.activation_func_clamp_value is not None and a.activation_func_clamp_value <= 0:
        out.append(
            f"--activation-func-clamp-value must be positive, got {a.activation_func_clamp_value}"
        )
    if a.window_size is not None:
        left, right = a.window_size
        if right != 0 or left < 0:
            out.append(
                f"--window-size {left},{right}: a causal model's window looks back only; use "
                "LEFT,0 with LEFT >= 0 (GPT-OSS: 127,0 for Hugging Face's sliding_window 128)"
            )
        freq = a.window_attn_skip_freq
        if isinstance(freq, tuple) and len(freq) != a.num_layers:
            out.append(
                f"--window-attn-skip-freq gives {len(freq)} layers for --num-layers {a.num_layers}"
            )
        elif isinstance(freq, int) and freq <= 0:
            out.append(f"--window-attn-skip-freq must be positive, got {freq}")
    given = [f"--{dest.replace('_', '-')}" for dest in YARN_FLAGS if getattr(a, dest) is not None]
    mla_own = [
        flag
        for flag in given
        if flag in ("--yarn-rotary-scaling-factor", "--yarn-mscale", "--yarn-mscale-all-dim")
    ]
    if a.multi_latent_attention and mla_own:
        out.append(
            f"{mla_own[0]}: multi-latent attention's YaRN takes --rotary-scaling-factor, --mscale "
            "and --mscale-all-dim"
        )
    elif given and not a.enable_gpt_oss and not a.multi_latent_attention:
        out.append(
            f"{given[0]} sets YaRN's values for --enable-gpt-oss or --multi-latent-attention: add "
            "one, or drop the flag"
        )
    if (
        a.softmax_type != "vanilla" or a.window_size is not None or a.enable_gpt_oss
    ) and a.multi_latent_attention:
        out.append(
            "--softmax-type, --window-size and --enable-gpt-oss are for standard attention, not "
            "--multi-latent-attention"
        )
    return out
