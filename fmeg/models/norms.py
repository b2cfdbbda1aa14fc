"""The model's norms (LayerNorm or RMSNorm, Megatron's --apply-layernorm-1p as a zero-centred
weight), over the hidden size or over each attention head's dimensions.

Sharding: the weights are replicated over tp; norm's input is whole in the hidden dimension (its
weight's gradient summed over tp by replicated_param where the sequence is split), head_norm's holds
this rank's heads (its gradient summed over tp by copy_to).
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg import ops
from fmeg.models.gpt_config import GPTConfig
from fmeg.parallel import collectives as C
from fmeg.parallel import exact_regions
from fmeg.parallel.tensor import NO_TP, TensorParallel, replicated_param

Params = dict[str, Any]


def norm(p: Params, x: torch.Tensor, config: GPTConfig, tp: TensorParallel = NO_TP) -> torch.Tensor:
    if tp.exact_sums:
        return _exact_norm(p, x, config, tp.group if tp.sp else None)
    weight, bias = replicated_param(p["weight"], tp), replicated_param(p.get("bias"), tp)
    if config.norm_zero_centered:
        weight = weight + 1.0
    if config.norm == "rmsnorm":
        return ops.rms_norm(x, weight, config.norm_eps)
    return ops.layer_norm(x, weight, bias, config.norm_eps)


def _exact_norm(p: Params, x: torch.Tensor, config: GPTConfig, group: Any) -> torch.Tensor:
    """--deterministic-mode's norm: the weight (and bias) applied a token at a time, so that their
    gradients are exact sums over the tokens and over group (the ranks splitting them): the same
    bits however the tokens are split (exact_regions.per_token)."""
    weight = exact_regions.per_token(p["weight"], x, group)
    bias = exact_regions.per_token(p["bias"], x, group) if "bias" in p else None
    if config.norm_zero_centered:
        weight = weight + 1.0
    if config.norm == "rmsnorm":
        return ops.rms_norm(x, None, config.norm_eps) * weight
    y = ops.layer_norm(x, None, None, config.norm_eps) * weight
    return y if bias is None else y + bias


def head_norm(
    p: Params, x_BNSD: torch.Tensor, config: GPTConfig, tp: TensorParallel = NO_TP
) -> torch.Tensor:
    """The norm over each head's dimensions. Its weight is replicated while the heads are split over
    tp, so each rank's gradient covers its own heads only: copy_to sums them over tp in backward."""
    if tp.exact_sums:
        return _exact_norm(p, x_BNSD, config, tp.group)
    weight, bias = p["weight"], p.get("bias")
    if tp.size > 1:
        weight, bias = (
            C.copy_to(weight, tp.group),
            None if bias is None else C.copy_to(bias, tp.group),
        )
    if config.norm_zero_centered:
        weight = weight + 1.0
    if config.norm == "rmsnorm":
        return ops.rms_norm(x_BNSD, weight, config.norm_eps)
    return ops.layer_norm(x_BNSD, weight, bias, config.norm_eps)
