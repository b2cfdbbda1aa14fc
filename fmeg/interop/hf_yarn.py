"""YaRN's rotary frequencies between transformers' rope_parameters and GPTConfig, for the families
that use them (DeepSeek-V3, GPT-OSS).

    fields = yarn_from_hf(hf.rope_parameters)     # GPTConfig's flat YaRN fields
    rope_parameters = yarn_to_hf(config.rope)     # ValueError where transformers cannot hold it
"""

from __future__ import annotations

from typing import Any

from fmeg.models.config_groups import RoPE


def yarn_from_hf(rope: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's YaRN fields of transformers' rope_parameters (rope_type "yarn")."""
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    # transformers then scales the tables by factor alone
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(rope["factor"]),
        original_max_position_embeddings=rope["original_max_position_embeddings"],
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(mscale),
        mscale_all_dim=float(mscale_all_dim),
        yarn_round_to_int=rope.get("truncate", True),
    )


def yarn_to_hf(rope: RoPE) -> dict[str, Any]:
    """transformers' rope_parameters of a YaRN RoPE; transformers takes mscale only with
    mscale_all_dim (ValueError otherwise)."""
    yarn = rope.yarn
    out = {
        "rope_type": "yarn",
        "rope_theta": rope.theta,
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position_embeddings,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "truncate": yarn.round_to_int,
    }
    if yarn.mscale_all_dim:
        return out | {"mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim}
    if yarn.mscale != 1.0:
        raise ValueError("to_hf: transformers' YaRN takes mscale only with mscale_all_dim")
    return out
