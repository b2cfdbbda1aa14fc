"""Dense projections. Weights are [out, in], as in torch and Megatron."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmeg.ops.weight_grads import DeferrableLinear, forward_deferrable


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias over the last dimension of x.

    A weight with more than two dimensions ([..., out_last, in]) is a stack of projections that
    share the input; the output's last dimension is its leading dimensions flattened, in order.
    Inside ops.weight_grads.deferrable() (a zero-bubble schedule's forward), its weight gradient
    can be deferred to the schedule's W.
    """
    if forward_deferrable():
        return DeferrableLinear.apply(x, weight, bias)
    if weight.dim() > 2:
        weight = weight.flatten(0, -2)
        bias = None if bias is None else bias.flatten()
    return F.linear(x, weight, bias)
