"""Megatron's flags for batches, the run's length, the optimizer and precision."""

from __future__ import annotations

from fmeg.config.declare import flag, group, not_positive, outside, switch

# the run's length when neither --train-iters nor --train-samples is given
DEFAULT_TRAIN_ITERS = 100


@group("batches and run length")
class TrainingFlags:
    """Batch sizes, their ramp, how long the run is, the loss's mean and the seed."""

    micro_batch_size: int = flag(
        "--micro-batch-size",
        type=int,
        default=4,
        help="samples a data-parallel rank runs through the model at a time",
    )
    global_batch_size: int | None = flag(
        "--global-batch-size", type=int, help="default: micro batch * data parallel"
    )
    rampup_batch_size: list[int] | None = flag(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES samples (current Megatron "
        "ignores it and takes --step-batch-size-schedule; fmeg still ramps)",
    )
    step_batch_size_schedule: str | None = flag(
        "--step-batch-size-schedule",
        metavar="'THRESHOLD:BATCH ...'",
        help="the global batch from each threshold in tokens on (K, M, B, T suffixes), e.g. "
        "'0:256 100M:512'; the last batch is the final one (--global-batch-size is ignored)",
    )
    train_iters: int | None = flag(
        "--train-iters", type=int, help=f"default {DEFAULT_TRAIN_ITERS}", exclusive="length"
    )
    train_samples: int | None = flag(
        "--train-samples",
        type=int,
        help="train for this many samples instead (the LR schedule then counts samples)",
        exclusive="length",
    )
    calculate_per_token_loss: bool = switch(
        "--calculate-per-token-loss",
        help="the loss is the global batch's token losses over its token count, not a mean of "
        "microbatch means",
    )
    deterministic_mode: bool = switch(
        "--deterministic-mode",
        help="every sum a layout splits taken exactly (fmeg.parallel.exact, exact_regions): the "
        "same bits at any data-parallel size, ZeRO-1, FSDP or neither, any number of microbatches "
        "a rank, "
        "and any tensor-parallel size dividing 8, with or without sequence parallelism; those "
        "over context, pipeline and expert parallelism not yet",
    )
    seed: int = flag(
        "--seed", type=int, default=1234, help="the seed of initialization, data order and dropout"
    )

    def problems(self) -> list[str]:
        """Batch sizes, the run's length (train_iters as parse_args derived it) and the seed."""
        out = not_positive(self, "micro_batch_size")
        if self.train_samples is None:
            out += not_positive(self, "train_iters")
        elif self.train_iters <= 0:
            out.append(
                f"--train-samples {self.train_samples} is less than one global batch; raise it"
            )
        if not 0 <= self.seed < 2**63:
            out.append(f"--seed must be in [0, 2**63), got {self.seed}")
        return out + not_positive(self, "global_batch_size")


@group("optimizer and learning rate")
class OptimizerFlags:
    """AdamW's hyperparameters, clipping, and the learning-rate and weight-decay schedules."""

    lr: float = flag("--lr", type=float, default=3e-3, help="the peak learning rate")
    min_lr: float = flag(
        "--min-lr", type=float, default=0.0, help="the learning rate the decay ends at"
    )
    decoupled_lr: float | None = flag(
        "--decoupled-lr",
        type=float,
        help="the word embedding's and output layer's peak LR (same warmup and decay)",
    )
    decoupled_min_lr: float | None = flag(
        "--decoupled-min-lr", type=float, help="their minimum LR (default --min-lr)"
    )
    lr_decay_style: str = flag(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_warmup_iters: int = flag(
        "--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup"
    )
    lr_warmup_init: float = flag(
        "--lr-warmup-init", type=float, default=0.0, help="the LR warmup starts from (default 0)"
    )
    lr_warmup_fraction: float | None = flag(
        "--lr-warmup-fraction",
        type=float,
        help="warm up over this fraction of the decay steps (replaces --lr-warmup-iters/-samples)",
    )
    lr_decay_iters: int | None = flag("--lr-decay-iters", type=int, help="default: --train-iters")
    lr_warmup_samples: int | None = flag(
        "--lr-warmup-samples", type=int, help="count the LR schedule in samples"
    )
    lr_decay_samples: int | None = flag(
        "--lr-decay-samples",
        type=int,
        help="samples over which the learning rate decays (schedules in samples)",
    )
    weight_decay: float = flag(
        "--weight-decay",
        type=float,
        default=0.01,
        help="AdamW's decoupled weight decay (not on biases and norms)",
    )
    start_weight_decay: float | None = flag(
        "--start-weight-decay", type=float, help="default: --weight-decay"
    )
    end_weight_decay: float | None = flag(
        "--end-weight-decay", type=float, help="default: --weight-decay"
    )
    weight_decay_incr_style: str = flag(
        "--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"]
    )
    clip_grad: float = flag(
        "--clip-grad",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this (0: no clipping)",
    )
    adam_beta1: float = flag(
        "--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay"
    )
    adam_beta2: float = flag(
        "--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay"
    )
    adam_eps: float = flag("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")

    def problems(self) -> list[str]:
        """The learning rates, their warmup, weight decay, clipping and Adam's constants."""
        out = not_positive(self, "lr", "adam_eps", "lr_decay_iters")
        if not 0 <= self.min_lr <= self.lr:
            out.append(f"--min-lr {self.min_lr} must be between 0 and --lr {self.lr}")
        if self.decoupled_lr is not None:
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if not 0 <= low <= self.decoupled_lr:
                out.append(
                    f"--decoupled-min-lr {low} must be between 0 and --decoupled-lr "
                    f"{self.decoupled_lr}"
                )
        elif self.decoupled_min_lr is not None:
            out.append("--decoupled-min-lr needs --decoupled-lr")
        if self.lr_warmup_fraction is not None:
            out += outside(self, "lr_warmup_fraction", 0, 1)
        if self.lr_warmup_iters < 0:
            out.append(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.clip_grad < 0:
            out.append(f"--clip-grad must be >= 0, got {self.clip_grad}")
        out += outside(self, "adam_beta1", 0, 1) + outside(self, "adam_beta2", 0, 1)
        start = self.weight_decay if self.start_weight_decay is None else self.start_weight_decay
        end = self.weight_decay if self.end_weight_decay is None else self.end_weight_decay
        if self.weight_decay_incr_style == "constant" and start != end:
            out.append(
                "--weight-decay-incr-style constant needs --start-weight-decay == "
                "--end-weight-decay"
            )
        if self.weight_decay < 0:
            out.append(f"--weight-decay must be >= 0, got {self.weight_decay}")
        return out


@group("precision")
class PrecisionFlags:
    """Compute and storage dtypes, and loss scaling."""

    bf16: bool = switch("--bf16", help="bf16 compute, fp32 main weights and gradients")
    fp16: bool = switch("--fp16", help="fp16 compute with a dynamic loss scaler")
    use_precision_aware_optimizer: bool = switch(
        "--use-precision-aware-optimizer",
        help="Adam's moments stored in --exp-avg-dtype and --exp-avg-sq-dtype, stepped in fp32",
    )
    main_grads_dtype: str = flag(
        "--main-grads-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="with --use-precision-aware-optimizer",
    )
    main_params_dtype: str = flag(
        "--main-params-dtype",
        choices=["fp32", "fp16"],
        default="fp32",
        help="with --use-precision-aware-optimizer",
    )
    exp_avg_dtype: str = flag(
        "--exp-avg-dtype",
        choices=["fp32", "fp16", "bf16", "fp8"],
        default="fp32",
        help="with --use-precision-aware-optimizer",
    )
    exp_avg_sq_dtype: str = flag(
        "--exp-avg-sq-dtype",
        choices=["fp32", "fp16", "bf16", "fp8"],
        default="fp32",
        help="with --use-precision-aware-optimizer",
    )
    grad_reduce_in_bf16: bool = switch(
        "--grad-reduce-in-bf16",
        help="with --bf16: accumulate and reduce gradients in bf16 (default fp32), as Megatron",
    )
    accumulate_allreduce_grads_in_fp32: bool = switch(
        "--accumulate-allreduce-grads-in-fp32",
        help="with --fp16: accumulate and reduce gradients in fp32 (default fp16, as Megatron); "
        "--bf16 always does unless --grad-reduce-in-bf16",
    )
    loss_scale: float | None = flag(
        "--loss-scale",
        type=float,
        help="a static loss scale (with --fp16 or --bf16; an overflowed step is skipped); default: "
        "--fp16's dynamic scaler",
    )
    initial_loss_scale: float = flag(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="--fp16's dynamic loss scale at the start",
    )
    min_loss_scale: float = flag(
        "--min-loss-scale", type=float, default=1.0, help="the dynamic loss scale's floor"
    )
    loss_scale_window: int = flag(
        "--loss-scale-window", type=int, default=1000, help="clean steps before the scale doubles"
    )
    hysteresis: int = flag(
        "--hysteresis", type=int, default=2, help="overflowed steps before the scale halves"
    )

    def problems(self) -> list[str]:
        """The dtypes chosen and the loss scaler's settings."""
        out = not_positive(self, "loss_scale")
        if self.fp16 and self.bf16:
            out.append("--fp16 and --bf16 are mutually exclusive; choose one")
        if not self.initial_loss_scale >= self.min_loss_scale > 0:
            out.append(
                f"--initial-loss-scale {self.initial_loss_scale} must be >= --min-loss-scale "
                f"{self.min_loss_scale} > 0"
            )
        if self.loss_scale_window <= 0 or self.hysteresis <= 0:
            out.append("--loss-scale-window and --hysteresis must be positive")
        return out
