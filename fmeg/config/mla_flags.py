"""Megatron's multi-latent attention flags (megatron/training/arguments.py's _add_mla_args, with
--rope-type): their parser group, the GPTConfig fields they set, and their rules.

As in Megatron, --rope-type defaults to yarn with --multi-latent-attention (megatron-core's
MLATransformerConfig) and to rope otherwise; YaRN with factor 1 (--rotary-scaling-factor's default)
is plain RoPE.
"""

from __future__ import annotations

import argparse

from fmeg.config.declare import flag, group, switch

# Megatron-Bridge's --yarn-* flags that MLA's YaRN also reads (megatron-core's MLATransformerConfig
# fields that Megatron's own flags leave at their defaults: original context 4096, beta_fast 32,
# beta_slow 1, rounded), so that an imported DeepSeek-V3 keeps its own under --use-checkpoint-args.
# {flag dest: GPTConfig field}
YARN_FLAGS = {
    "yarn_original_max_position_embeddings": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_correction_range_round_to_int": "yarn_round_to_int",
}

IGNORED = {
    "--cache-mla-latents": "a choice of Megatron's dynamic inference engine (Flash MLA); fmeg's "
    "generation caches the expanded keys and values"
}


@group("multi-latent attention")
class MLAFlags:
    """DeepSeek's multi-latent attention and its YaRN rotary frequencies."""

    ACCEPTED = {f: dict(action="store_true", help=argparse.SUPPRESS) for f in IGNORED}

    multi_latent_attention: bool = switch(
        "--multi-latent-attention",
        help="DeepSeek's multi-latent attention: keys and values from one low-rank latent",
    )
    q_lora_rank: int | None = flag(
        "--q-lora-rank",
        type=int,
        help="the queries' low-rank latent (default: queries straight from the hidden states)",
    )
    kv_lora_rank: int = flag(
        "--kv-lora-rank", type=int, default=32, help="the keys' and values' latent"
    )
    qk_head_dim: int = flag(
        "--qk-head-dim", type=int, default=128, help="each head's query/key dimensions without RoPE"
    )
    qk_pos_emb_head_dim: int = flag(
        "--qk-pos-emb-head-dim",
        type=int,
        default=64,
        help="each head's rotated query/key dimensions",
    )
    v_head_dim: int = flag(
        "--v-head-dim", type=int, default=128, help="each head's value dimensions"
    )
    rotary_scaling_factor: float = flag(
        "--rotary-scaling-factor", type=float, default=1.0, help="YaRN's context extension factor"
    )
    mscale: float = flag(
        "--mscale", type=float, default=1.0, help="YaRN's attention temperature of the rotary part"
    )
    mscale_all_dim: float = flag(
        "--mscale-all-dim",
        type=float,
        default=0.0,
        help="YaRN's attention temperature of the whole softmax (multi-latent attention)",
    )
    rope_type: str | None = flag(
        "--rope-type",
        choices=["rope", "yarn"],
        help="rotary frequencies: rope, or YaRN's (default: yarn with --multi-latent-attention, "
        "else rope)",
    )


def rope_type(a: argparse.Namespace) -> str:
    return a.rope_type or ("yarn" if a.multi_latent_attention else "rope")


def model_fields(a: argparse.Namespace) -> dict:
    """The GPTConfig fields of these flags (none without --multi-latent-attention)."""
    if not a.multi_latent_attention:
        return {}
    return dict(
        multi_latent_attention=True,
        num_kv_heads=None,
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_head_dim=a.qk_head_dim,
        qk_pos_emb_head_dim=a.qk_pos_emb_head_dim,
        v_head_dim=a.v_head_dim,
        rope_type=rope_type(a),
        rotary_scaling_factor=a.rotary_scaling_factor,
        mscale=a.mscale,
        mscale_all_dim=a.mscale_all_dim,
        **{
            field: getattr(a, dest)
            for dest, field in YARN_FLAGS.items()
            if getattr(a, dest, None) is not None
        },
    )


def problems(a: argparse.Namespace) -> list[str]:
    """One line for each multi-latent attention flag that cannot run."""
    out = []
    if not a.multi_latent_attention:
        return out
    if a.position_embedding_type != "rope":
        out.append(
            "--multi-latent-attention rotates its own rotary part: use --position-embedding-type "
            f"rope, not {a.position_embedding_type}"
        )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
        value = getattr(a, name)
        if value is not None and value <= 0:
            out.append(f"--{name.replace('_', '-')} must be positive, got {value}")
    if a.qk_pos_emb_head_dim % 2:
        out.append(
            f"--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)"
        )
    if a.v_head_dim > a.qk_head_dim + a.qk_pos_emb_head_dim:
        out.append(
            f"--v-head-dim {a.v_head_dim} must not exceed --qk-head-dim + --qk-pos-emb-head-dim "
            f"({a.qk_head_dim + a.qk_pos_emb_head_dim})"
        )
    if a.rotary_scaling_factor <= 0:
        out.append(f"--rotary-scaling-factor must be positive, got {a.rotary_scaling_factor}")
    return out


def ignored(a: argparse.Namespace) -> list[str]:
    lines = [
        f"{flag}: {why}"
        for flag, why in IGNORED.items()
        if getattr(a, flag.lstrip("-").replace("-", "_"))
    ]
    if a.rope_type == "yarn" and not a.multi_latent_attention:
        lines.append(
            "--rope-type yarn: megatron-core reads it with --multi-latent-attention only; "
            "standard attention keeps plain RoPE (GPT-OSS's YaRN: --enable-gpt-oss)"
        )
    return lines
