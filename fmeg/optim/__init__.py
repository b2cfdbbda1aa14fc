"""Functional optimizers and schedules (optax-style: state is a pytree, nothing is mutated)."""

from fmeg.optim.adamw import AdamState, Optimizer, adamw, apply_updates, clip_by_global_norm, default_decay_mask
from fmeg.optim.schedules import LRSchedule, WeightDecaySchedule

__all__ = ["AdamState", "LRSchedule", "Optimizer", "WeightDecaySchedule", "adamw", "apply_updates",
           "clip_by_global_norm", "default_decay_mask"]
