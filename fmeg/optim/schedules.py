"""Learning-rate and weight-decay schedules: pure functions of a step count.

The count is in whatever unit the caller chooses (iterations, or samples as Megatron counts them
when --lr-warmup-samples and friends are used); warmup and decay lengths are in the same unit.
The formulas are Megatron's OptimizerParamScheduler's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup from init_lr to max_lr, then decay to min_lr by decay_steps, min_lr after."""

    max_lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    # None: constant after warmup
    decay_steps: int | None = None
    style: str = "linear"
    init_lr: float = 0.0
    # WSD: length of the final anneal inside decay_steps
    wsd_decay_steps: int | None = None
    wsd_style: str = "exponential"

    def __post_init__(self) -> None:
        if self.style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {DECAY_STYLES}, got {self.style!r}")
        if self.wsd_style not in WSD_STYLES:
            raise ValueError(
                f"--lr-wsd-decay-style must be one of {WSD_STYLES}, got {self.wsd_style!r}"
            )
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be between 0 and --lr ({self.max_lr})")
        if self.warmup_steps < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.warmup_steps}")
        decays = self.style not in ("constant",) and self.decay_steps is not None
        if decays and self.decay_steps <= self.warmup_steps and self.style != "inverse-square-root":
            raise ValueError(
                f"--lr-decay-iters ({self.decay_steps}) must exceed --lr-warmup-iters "
                f"({self.warmup_steps})"
            )
        if self.style == "WSD" and (
            self.wsd_decay_steps is None
            or self.decay_steps is None
            or not 0 < self.wsd_decay_steps <= self.decay_steps
        ):
            raise ValueError(
                "--lr-decay-style WSD needs 0 < --lr-wsd-decay-iters <= --lr-decay-iters"
            )

    def __call__(self, step: float) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.warmup_steps
        if self.style == "constant" or self.decay_steps is None:
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        if self.style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(step, 1) ** 0.5
            return max(self.min_lr, lr)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = _wsd_coeff(self, step)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def _wsd_coeff(s: LRSchedule, step: float) -> float:
    anneal_start = s.decay_steps - s.wsd_decay_steps
    if step <= anneal_start:
        return 1.0
    ratio = (step - anneal_start) / s.wsd_decay_steps
    return {
        "linear": lambda r: 1.0 - r,
        "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
        "exponential": lambda r: 2.0 * 0.5**r - 1.0,
        "minus_sqrt": lambda r: 1.0 - math.sqrt(r),
    }[s.wsd_style](ratio)


@dataclass(frozen=True)
class WeightDecaySchedule:
    """Weight decay moving from start to end over incr_steps (Megatron's
    --weight-decay-incr-style)."""

    start: float
    # None: start (constant)
    end: float | None = None
    incr_steps: int | None = None
    style: str = "constant"

    def __post_init__(self) -> None:
        if self.style not in WD_STYLES:
            raise ValueError(
                f"--weight-decay-incr-style must be one of {WD_STYLES}, got {self.style!r}"
            )
        if self.style == "constant" and self.end is not None and self.end != self.start:
            raise ValueError(
                "--weight-decay-incr-style constant needs --start-weight-decay == "
                "--end-weight-decay"
            )
        if self.style != "constant" and (
            self.end is None or not self.incr_steps or self.incr_steps <= 0
        ):
            raise ValueError(
                f"--weight-decay-incr-style {self.style} needs an end weight decay and positive "
                "steps"
            )

    def __call__(self, step: float) -> float:
        if self.style == "constant":
            return self.start
        if step > self.incr_steps:
            return self.end
        ratio = step / self.incr_steps
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start + coeff * (self.end - self.start)
