"""How one training step runs, apart from what it runs on (the model's config, the layout, the mesh,
the state and the microbatches): this step's optimizer hyperparameters, the overflow check, the
objective and the performance policies. The loss scale is the state's (state.scaler).

    settings = StepSettings(lr=3e-4, weight_decay=0.1, clip_grad=1.0)
    train_iteration(state, microbatches, config=c, layout=layout, mesh=mesh, settings=settings)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    # this step's optimizer hyperparameters: the schedules' values now
    lr: float
    weight_decay: float
    clip_grad: float
    # the word embedding's and output layer's learning rate (Megatron's --decoupled-lr; None: lr)
    decoupled_lr: float | None = None
    # with check_overflow (always, when the state has a loss scaler) a step whose gradients hold
    # inf/nan on any rank changes nothing and reports skipped=True
    check_overflow: bool = False
    # the loss is the global batch's token losses over its token count (Megatron's
    # --calculate-per-token-loss), not the mean of the microbatch means
    per_token: bool = False
    # how the step runs, not what it computes: forward_backward's overlap and buckets, and
    # stage_functions' compilation
    overlap_grad_reduce: bool = False
    bucket_numel: int | None = None
    compile: str | None = None
    # --deterministic-mode: the sums over data parallelism (gradients, loss, grad norm) exact, so
    # the same bits at any dp and any number of microbatches a rank (fmeg.parallel.exact)
    deterministic: bool = False
    # the run's fmeg.fp8.plan.Fp8Plan: which layers' GEMMs run in FP8, and how (None: none)
    fp8: Any = None
