"""Megatron's flags for saving, loading and stopping."""

from __future__ import annotations

import os


from fmeg.config.declare import not_positive, flag, group, switch


@group("checkpoints")
class CheckpointFlags:
    """Where checkpoints go, what they hold and how they are read."""

    save: str | None = flag("--save", help="checkpoint directory")
    save_interval: int | None = flag(
        "--save-interval", type=int, help="save every N iterations (and at the end)"
    )
    load: str | None = flag("--load", help="resume from the newest checkpoint in this directory")
    no_load_optim: bool = switch(
        "--no-load-optim",
        help="with --load: take the weights, iteration and samples, but start a fresh optimizer "
        "state",
    )
    no_save_optim: bool = switch(
        "--no-save-optim",
        help="write the weights only (no master weights, moments or loss scale): such a checkpoint "
        "resumes with --no-load-optim or --finetune, as Megatron's",
    )
    use_checkpoint_args: bool = switch(
        "--use-checkpoint-args",
        help="with --load: take the model's flags (sizes, norms, activation, positions...) from "
        "the checkpoint, as Megatron's; the run's other flags stay yours",
    )
    finetune: bool = switch(
        "--finetune",
        help="with --load: take the weights only; iteration, samples and optimizer start afresh",
    )
    keep_last: int | None = flag("--keep-last", type=int, help="keep only the newest K checkpoints")
    async_save: bool = switch(
        "--async-save",
        help="write checkpoints in the background while training goes on (copied to host memory "
        "first)",
    )
    ckpt_fully_parallel_save: bool = switch(
        "--ckpt-fully-parallel-save",
        default=True,
        help="spread the writing of replicated tensors over their data-parallel replicas (the "
        "default, as Megatron's)",
        negation=(
            "--no-ckpt-fully-parallel-save",
            "write each replicated tensor from its first replica only",
        ),
    )
    ckpt_fully_parallel_load: bool = switch(
        "--ckpt-fully-parallel-load",
        help="read replicated tensors once over their data-parallel replicas, which exchange them",
    )
    exit_on_missing_checkpoint: bool = switch(
        "--exit-on-missing-checkpoint",
        help="with --load: stop (exit 2) instead of starting afresh when it holds no checkpoint",
    )

    def problems(self) -> list[str]:
        out = not_positive(self, "save_interval")
        if self.keep_last is not None and self.keep_last <= 0:
            out.append("--keep-last must be positive")
        if self.load is not None and os.path.isfile(self.load):
            out.append(f"--load {self.load} is a file; name the checkpoint directory")
        return out


@group("exit and failure checks")
class ExitFlags:
    """When the run stops early and what it does at a non-finite loss."""

    exit_signal_handler: bool = switch(
        "--exit-signal-handler", help="on --exit-signal (SIGTERM): save (with --save) and exit 0"
    )
    exit_signal: str = flag(
        "--exit-signal",
        default="SIGTERM",
        choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
        help="the signal --exit-signal-handler catches",
    )
    exit_interval: int | None = flag(
        "--exit-interval", type=int, help="exit after iterations divisible by N"
    )
    exit_duration_in_mins: float | None = flag(
        "--exit-duration-in-mins", type=float, help="exit after this many minutes"
    )
    check_for_nan_in_loss_and_grad: bool = switch(
        "--check-for-nan-in-loss-and-grad",
        default=True,
        help="stop (exit 1) at a non-finite loss or gradient, as Megatron by default; with a loss "
        "scaler, at a non-finite loss or an overflow at --min-loss-scale (others it skips)",
        negation=(
            "--no-check-for-nan-in-loss-and-grad",
            "go on past non-finite losses and gradients (counted in the log line)",
        ),
    )
    fail_on_nan: bool = switch("--fail-on-nan", help="fmeg's older name of the default check")

    def problems(self) -> list[str]:
        return not_positive(self, "exit_interval")
