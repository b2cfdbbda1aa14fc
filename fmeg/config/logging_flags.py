"""Megatron's flags for logging and validation."""

from __future__ import annotations


from fmeg.config.declare import not_positive, flag, group, switch


@group("logging")
class LoggingFlags:
    """Validation, the log line, and where metrics are written."""

    eval_interval: int | None = flag(
        "--eval-interval", type=int, help="validate every N iterations (and at the end)"
    )
    eval_global_batch_size: int | None = flag(
        "--eval-global-batch-size",
        type=int,
        help="Megatron's validation batch: the global batch (the only one fmeg takes)",
    )
    eval_iters: int = flag(
        "--eval-iters", type=int, default=2, help="global batches per validation"
    )
    log_interval: int = flag(
        "--log-interval", type=int, default=10, help="iterations between log lines"
    )
    log_params_norm: bool = switch(
        "--log-params-norm", help="add the parameters' global L2 norm to the log line and metrics"
    )
    log_dir: str | None = flag("--log-dir", help="write metrics.jsonl (and loss.png) here")
    tensorboard_dir: str | None = flag(
        "--tensorboard-dir", help="also write TensorBoard scalars here (pip install tensorboard)"
    )
    wandb_project: str = flag(
        "--wandb-project",
        default="",
        help="also log to Weights & Biases in this project (pip install "
        "wandb; offline unless WANDB_API_KEY is set)",
    )
    wandb_exp_name: str = flag("--wandb-exp-name", default="", help="the W&B run's name")
    wandb_save_dir: str = flag(
        "--wandb-save-dir", default="", help="where W&B writes its files (default: --log-dir or .)"
    )
    wandb_entity: str = flag("--wandb-entity", default="", help="the W&B team or user")
    logging_level: int | None = flag(
        "--logging-level", type=int, help="Python logging's level (e.g. 20 for INFO)"
    )

    def problems(self) -> list[str]:
        out = not_positive(self, "log_interval", "eval_interval")
        if self.eval_iters < 0:
            out.append(f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.tensorboard_dir:
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                out.append(
                    "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
                )
        return out
