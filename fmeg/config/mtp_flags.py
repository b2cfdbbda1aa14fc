"""Megatron's multi-token prediction flags (megatron/training/arguments.py: --mtp-num-layers,
--mtp-loss-scaling-factor): their parser group, the GPTConfig fields they set, and their rules."""

from __future__ import annotations

import argparse

from fmeg.config.declare import flag, group


@group("multi-token prediction")
class MTPFlags:
    """DeepSeek-V3's multi-token prediction."""

    mtp_num_layers: int | None = flag(
        "--mtp-num-layers",
        type=int,
        help="DeepSeek-V3's multi-token prediction: this many extra layers, each one token further",
    )
    mtp_loss_scaling_factor: float = flag(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="the MTP losses' weight: their mean over the depths times this joins the objective",
    )


def model_fields(a: argparse.Namespace) -> dict:
    """The GPTConfig fields of these flags (none without --mtp-num-layers)."""
    if not a.mtp_num_layers:
        return {}
    return dict(mtp_num_layers=a.mtp_num_layers, mtp_loss_scaling_factor=a.mtp_loss_scaling_factor)


def problems(a: argparse.Namespace) -> list[str]:
    """One line for each multi-token prediction flag that cannot run."""
    if a.mtp_num_layers is None or a.mtp_num_layers == 0:
        return []
    if a.mtp_num_layers < 0:
        return [f"--mtp-num-layers must be positive, got {a.mtp_num_layers}"]
    if a.seq_length and a.mtp_num_layers >= a.seq_length > 0:
        # depth k shifts the targets k places left: from depth --seq-length on, no place of a sample
        # has one
        return [
            f"--mtp-num-layers {a.mtp_num_layers}: depths from {a.seq_length} on would have no "
            f"target in a --seq-length {a.seq_length} sample; use at most {a.seq_length - 1}"
        ]
    if a.position_embedding_type != "rope":
        return [
            "--mtp-num-layers needs --position-embedding-type rope (its layers on the last "
            f"pipeline stage would need the first stage's {a.position_embedding_type} position "
            "table)"
        ]
    return []
