"""Optimizers in optax's shape (init and update over pytrees; nothing is mutated), their flat-buffer
form, and the learning-rate and weight-decay schedules."""

from fmeg.optim.adam import FusedAdamW, adamw, clip_scale
from fmeg.optim.base import EmptyState, GradientTransformation, apply_updates, chain, stateless
from fmeg.optim.loss_scale import LossScaledFlat, LossScaledState, with_loss_scale
from fmeg.optim.schedules import LRSchedule, WeightDecaySchedule
from fmeg.optim.transforms import (
    AdamState,
    ClipState,
    add_decayed_weights,
    clip_by_global_norm,
    default_decay_mask,
    scale_by_adam,
    scale_by_learning_rate,
)

__all__ = [
    "AdamState",
    "ClipState",
    "EmptyState",
    "FusedAdamW",
    "GradientTransformation",
    "LRSchedule",
    "LossScaledFlat",
    "LossScaledState",
    "WeightDecaySchedule",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_scale",
    "default_decay_mask",
    "scale_by_adam",
    "scale_by_learning_rate",
    "stateless",
    "with_loss_scale",
]
