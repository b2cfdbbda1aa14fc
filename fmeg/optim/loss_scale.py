"""Megatron's dynamic loss scaler for fp16, as a pure function of its state.

    state = LossScale(scale=2.0**32)
    # after every step; an overflowed step is skipped by the caller
    state = update(state, overflow)

The scale halves (never below min_scale) once `hysteresis` overflowed steps have been seen since the
last growth, and doubles after `window` consecutive clean steps. A static scale (Megatron's
--loss-scale) never changes; an overflowed step is still skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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
