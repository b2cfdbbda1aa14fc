"""Language-model cross entropy with an ignore index, a loss mask and label smoothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmeg.ops.precision import upcast

IGNORE_INDEX = -100


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token loss [*labels.shape] in at least fp32; 0 where labels == ignore_index.

    With smoothing e over V classes: (1 - e) * (lse - logit[label]) + e * (lse - mean(logits)),
    the same definition as torch.nn.functional.cross_entropy.
    """
    flat = upcast(logits.reshape(-1, logits.shape[-1]))
    losses = F.cross_entropy(
        flat,
        labels.reshape(-1),
        reduction="none",
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
    return losses.view(labels.shape)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(values * mask) / sum(mask) (0 when the mask is empty), as Megatron averages lm loss."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean token loss over tokens whose label is not ignore_index and whose loss_mask is
    nonzero."""
    losses = token_cross_entropy(
        logits, labels, label_smoothing=label_smoothing, ignore_index=ignore_index
    )
    mask = labels != ignore_index
    if loss_mask is not None:
        mask = mask * loss_mask.to(losses.dtype)
    return masked_mean(losses, mask)
