"""The training loop's decisions as small pure functions: where the run stands, what resuming means,
when to evaluate, save or exit, and what a non-finite step does. The runner calls them; tests call
them without processes.

    progress = Progress()                                       # a fresh run
    plan = resume(meta, finetune=False, no_load_optim=False, in_samples=False, scaler=None)
    progress = plan.progress.after_step(global_batch=8, skipped=False, in_samples=False)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fmeg.checkpoint import CheckpointError
from fmeg.optim import loss_scale


@dataclass(frozen=True)
class Progress:
    """Where the run stands after `iteration` iterations: samples consumed by training and
    validation, the LR and weight-decay schedules' position (samples or iterations of successful
    updates, as Megatron's scheduler advances only after an update), and the counts of the log line
    (the loss scaler is the training state's, part of the optimizer's)."""

    iteration: int = 0
    consumed: int = 0
    valid_consumed: int = 0
    scheduled: int = 0
    # steps the loss scaler skipped
    skipped: int = 0
    # iterations with a non-finite loss or gradient and no scaler
    nans: int = 0

    def after_step(
        self,
        *,
        global_batch: int,
        skipped: bool,
        in_samples: bool,
        non_finite: bool = False,
        scaled: bool = False,
    ) -> Progress:
        """The progress after an iteration of global_batch samples; skipped: its update was not
        applied (an overflow the scaler skips, or a non-finite step without one); non_finite: its
        loss or gradient was; scaled: the step had a loss scaler."""
        return replace(
            self,
            iteration=self.iteration + 1,
            consumed=self.consumed + global_batch,
            scheduled=self.scheduled + (0 if skipped else global_batch if in_samples else 1),
            skipped=self.skipped + int(skipped and scaled),
            nans=self.nans + int((skipped or non_finite) and not scaled),
        )


@dataclass(frozen=True)
class Resume:
    progress: Progress
    # the loss scaler to go on with (None: no scaling)
    scaler: loss_scale.LossScale | None
    # rebuild the optimizer state from the loaded weights
    fresh_optimizer: bool
    # "resumed from ... (iteration 40, 320 samples; layout unchanged)"
    description: str


def resume(
    meta: dict,
    *,
    finetune: bool,
    no_load_optim: bool,
    in_samples: bool,
    scaler: loss_scale.LossScale | None,
    layout_note: str = "layout unchanged",
    path: str = "",
) -> Resume:
    """What loading a checkpoint with this metadata means, as Megatron means it: --finetune takes
    the weights only (iteration, samples, schedules and optimizer start afresh); --no-load-optim
    takes the weights, the iteration and the samples, and starts the optimizer state, the LR and
    weight-decay schedules and the loss scaler afresh (they belong to Megatron's optimizer state);
    otherwise everything continues."""
    missing = [key for key in ("iteration", "consumed_samples") if key not in meta]
    if missing:
        raise CheckpointError(
            f"{path}: its metadata has no {missing[0]}; the file is damaged: restore it"
        )
    if finetune:
        return Resume(
            Progress(),
            scaler,
            True,
            f"fine-tuning from {path} (iteration {meta['iteration']}, {meta['consumed_samples']} "
            "samples; weights only)",
        )
    consumed = meta["consumed_samples"]
    scheduled = (
        0
        if no_load_optim
        else meta.get("scheduler_steps", consumed if in_samples else meta["iteration"])
    )
    if scaler is not None and meta.get("loss_scale") and not no_load_optim:
        fields = meta["loss_scale"]
        try:
            saved = loss_scale.LossScale(**fields)
        except TypeError:
            saved = None
        if saved is None or not all(isinstance(v, (int, float)) for v in fields.values()):
            raise CheckpointError(
                f"{path}: loss_scale {fields} is not a loss scaler's state; the metadata is "
                "damaged: restore it, or resume with --no-load-optim"
            )
        # a static --loss-scale is the flag's
        scaler = scaler if scaler.static or saved.static else saved
    taken = "fresh optimizer state and schedules" if no_load_optim else layout_note
    return Resume(
        Progress(meta["iteration"], consumed, meta.get("valid_consumed_samples", 0), scheduled),
        scaler,
        no_load_optim,
        f"resumed from {path} (iteration {meta['iteration']}, {consumed} samples; {taken})",
    )


def exit_reasons(
    iteration: int,
    *,
    exit_interval: int | None,
    exit_duration_in_mins: float | None,
    minutes_since_start: float,
    signalled: bool,
    signal_name: str = "SIGTERM",
) -> list[str]:
    """Why this rank would stop after this iteration (the runner makes every rank agree)."""
    reasons = []
    if signalled:
        reasons.append(f"{signal_name} received")
    if exit_interval and iteration % exit_interval == 0:
        reasons.append(f"--exit-interval {exit_interval}")
    if exit_duration_in_mins is not None and minutes_since_start >= exit_duration_in_mins:
        reasons.append(f"--exit-duration-in-mins {exit_duration_in_mins}")
    return reasons


def should_evaluate(iteration: int, *, eval_interval: int | None, train_iters: int) -> bool:
    return bool(eval_interval) and (iteration % eval_interval == 0 or iteration == train_iters)


def should_save(
    iteration: int, *, save: str | None, save_interval: int | None, train_iters: int, exiting: bool
) -> bool:
    """Megatron's: every --save-interval iterations, at the end, and before an exit."""
    return bool(save) and (
        exiting
        or bool(save_interval and iteration % save_interval == 0)
        or iteration == train_iters
    )


def non_finite_stop(
    *,
    skipped: bool,
    loss_non_finite: bool,
    scaler: loss_scale.LossScale | None,
    check_for_nan: bool,
) -> str | None:
    """Why a step stops the run (None: go on), with Megatron's --check-for-nan-in-loss-and-grad (the
    default): a non-finite loss always stops; a non-finite gradient stops without a loss scaler, and
    with one only when the scale was already at its floor (a dynamic scaler skips and lowers it
    otherwise; a static one skips)."""
    if not check_for_nan or not (skipped or loss_non_finite):
        return None
    if loss_non_finite:
        return "non-finite loss"
    if scaler is None:
        return "non-finite gradient"
    if not scaler.static and scaler.scale <= scaler.min_scale:
        return f"the gradient overflowed at the minimum loss scale {scaler.min_scale:g}"
    return None
