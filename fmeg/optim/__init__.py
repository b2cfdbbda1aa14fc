"""Optimizers in optax's shape (init and update over pytrees; nothing is mutated): AdamW, SGD,
Lion (alone, or on the matrices with Adam on the rest), Muon and adaptive Muon, SOAP; their
flat-buffer forms; the learning-rate and weight-decay schedules."""

from fmeg.optim.adam import FusedAdamW, adamw, clip_scale
from fmeg.optim.base import (
    EmptyState,
    GradientTransformation,
    apply_updates,
    chain,
    partition,
    stateless,
)
from fmeg.optim.loss_scale import LossScaledFlat, LossScaledState, with_loss_scale
from fmeg.optim.muon import LeafMatrices, MuonSettings, MuonState, TwoDimensional, muon
from fmeg.optim.newton_schulz import newton_schulz, scale_factor
from fmeg.optim.schedules import LRSchedule, WeightDecaySchedule
from fmeg.optim.soap import SoapSettings, soap
from fmeg.optim.sgd import MomentumState, lion, lion_on_matrices, sgd
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
    "LeafMatrices",
    "SoapSettings",
    "LossScaledFlat",
    "LossScaledState",
    "MomentumState",
    "MuonSettings",
    "MuonState",
    "TwoDimensional",
    "WeightDecaySchedule",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_scale",
    "default_decay_mask",
    "lion",
    "lion_on_matrices",
    "muon",
    "newton_schulz",
    "partition",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_factor",
    "soap",
    "sgd",
    "stateless",
    "with_loss_scale",
]
