"""Megatron's dynamic loss scaler for fp16, as a pure function of its state, and as a gradient
transformation wrapping an optimizer.

    state = LossScale(scale=2.0**32)
    # after every step; an overflowed step is skipped by the caller
    state = update(state, overflow)

    tx = with_loss_scale(adamw(), initial())       # optax's shape
    opt_state = tx.init(params)
    grads = grad(lambda p: loss(p) * opt_state.scaler.scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params, lr=lr, weight_decay=wd)
    tx.flat.scaler                                 # the runner's state starts from it (flat form)

The scale halves (never below min_scale) once `hysteresis` overflowed steps have been seen since the
last growth, and doubles after `window` consecutive clean steps. A static scale (Megatron's
--loss-scale) never changes; an overflowed step is still skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from fmeg import tree
from fmeg.optim.base import GradientTransformation


@dataclass(frozen=True)
class LossScale:
    scale: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    clean_steps: int = 0
    hysteresis_left: int = 2
    static: bool = False


def initial(
    scale: float = 2.0**32, min_scale: float = 1.0, window: int = 1000, hysteresis: int = 2
) -> LossScale:
    return LossScale(scale, min_scale, window, hysteresis, 0, hysteresis)


def static(scale: float) -> LossScale:
    return LossScale(scale, scale, 0, 0, 0, 0, static=True)


def update(state: LossScale, overflow: bool) -> LossScale:
    """The scaler after a step that overflowed or not."""
    if state.static:
        return state
    if overflow:
        left = state.hysteresis_left - 1
        scale = max(state.scale * 0.5, state.min_scale) if left <= 0 else state.scale
        return replace(state, scale=scale, clean_steps=0, hysteresis_left=max(left, 0))
    clean = state.clean_steps + 1
    if clean == state.window:
        return replace(
            state, scale=state.scale * 2.0, clean_steps=0, hysteresis_left=state.hysteresis
        )
    return replace(state, clean_steps=clean)


class LossScaledState(NamedTuple):
    # the scaler the next step's loss is multiplied by (scaler.scale)
    scaler: LossScale
    # the wrapped optimizer's state, unchanged by a skipped step
    inner: Any


class LossScaledFlat(NamedTuple):
    """with_loss_scale's flat form: the inner flat form stepped on the unscaled owned gradient,
    and the scaler a training state starts with. The state holds the scaler (state.scaler, saved
    with the optimizer); train_iteration scales the loss by it, unscales the gradient, skips a
    step whose gradient overflowed on any rank and updates the scaler, as the pytree form does."""

    inner: Any
    scaler: LossScale

    def __getattr__(self, name: str) -> Any:
        # everything else (moment_dtypes, group, step_, the matrix step's methods) is inner's
        return getattr(self.inner, name)


def with_loss_scale(inner: GradientTransformation, scaler: LossScale) -> GradientTransformation:
    """inner, given the gradients of the loss times state.scaler.scale: they are unscaled, and a
    step whose gradients hold inf or nan is skipped (zero updates, inner's state kept) and lowers
    the scale as update() says. Its flat form (LossScaledFlat) is the same on the runner's
    buffers. Reading whether the gradients are finite is a host sync."""

    def init(params: Any) -> LossScaledState:
        return LossScaledState(scaler, inner.init(params))

    def unscaled_update(grads: Any, state: LossScaledState, params: Any = None, **hyper: Any):
        scale = state.scaler.scale
        unscaled = tree.tree_map(lambda g: g.float() / scale, grads)
        leaves = tree.tree_leaves(unscaled)
        finite = bool(torch.stack([torch.isfinite(g).all() for g in leaves]).all())
        if not finite:
            zeros = tree.tree_map(torch.zeros_like, unscaled)
            return zeros, LossScaledState(update(state.scaler, True), state.inner)
        updates, inner_state = inner.update(unscaled, state.inner, params, **hyper)
        return updates, LossScaledState(update(state.scaler, False), inner_state)

    flat = LossScaledFlat(inner.flat, scaler) if inner.flat is not None else None
    return GradientTransformation(init, unscaled_update, flat)


def scaler_of(optimizer: GradientTransformation) -> LossScale | None:
    """The loss scaler a state stepping optimizer's flat form starts with (None: no scaling)."""
    return optimizer.flat.scaler if isinstance(optimizer.flat, LossScaledFlat) else None
