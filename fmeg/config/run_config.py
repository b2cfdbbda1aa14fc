"""The run's configuration: Megatron's flags, once validated, as frozen groups the runner reads.

    a = parse_args(argv); problems = validate(a, world)          # fmeg.config.arguments
    cfg = RunConfig.from_args(a, world, tokenizer.vocab_size)    # nothing reads `a` after this

Groups follow Megatron's own configuration groups: the model (gpt.GPTConfig), the parallel layout
(fmeg.parallel.layout.Layout: the one description of tp, pp, virtual chunks, dp and microbatches
that the step, the checkpoints and the logs use), training and its schedules, precision, data,
checkpointing and logging.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fmeg import optim
from fmeg.data.fim import FIMSettings
from fmeg.data.tokenizers import padded_vocab_size
from fmeg.models import gpt
from fmeg.optim import loss_scale
from fmeg.config.arguments import batch_geometry, lr_steps
from fmeg.config.batch_schedule import global_batch_size, parse_step_schedule
from fmeg.config import context_flags, fsdp_flags, gpt_oss_flags, mla_flags, moe_flags, mtp_flags
from fmeg.config.megatron_flags import activation, ignored_flags
from fmeg.config import fp8_flags
from fmeg.config.optimizer_flags import OptimizerConfig, optimizer_config
from fmeg.fp8.plan import Fp8Plan
from fmeg.parallel.layout import Layout


def model_config(a, vocab_size: int) -> gpt.GPTConfig:
    """The model of the flags for a tokenizer of vocab_size ids, padded as Megatron pads for this tp
    (the padding changes no number: gpt.GPTConfig.padded_vocab_size)."""
    padded = a.padded_vocab_size or padded_vocab_size(
        vocab_size, a.tensor_model_parallel_size, a.make_vocab_size_divisible_by
    )
    fields = dict(
        vocab_size=vocab_size,
        padded_vocab_size=padded,
        max_seq_len=a.max_position_embeddings or a.seq_length,
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_heads=a.num_attention_heads,
        num_kv_heads=a.num_query_groups,
        ffn_hidden_size=a.ffn_hidden_size,
        norm="rmsnorm" if a.normalization == "RMSNorm" else "layernorm",
        activation=activation(a),
        norm_eps=a.norm_epsilon,
        norm_zero_centered=a.apply_layernorm_1p,
        kv_channels=a.kv_channels,
        tie_embeddings=not a.untie_embeddings_and_output_weights,
        bias=not a.disable_bias_linear,
        init_std=a.init_method_std,
        hidden_dropout=a.hidden_dropout,
        attention_dropout=a.attention_dropout,
        qk_norm=a.qk_layernorm,
        qkv_bias=a.add_qkv_bias and a.disable_bias_linear,
        **moe_flags.model_fields(a),
    )
    extra = mla_flags.model_fields(a) | mtp_flags.model_fields(a) | gpt_oss_flags.model_fields(a)
    return gpt.GPTConfig(**(fields | _rope_fields(a) | extra))


def _rope_fields(a) -> dict:
    """RoPE's fields of the flags: none with learned positions (Megatron ignores them then)."""
    if a.position_embedding_type != "rope":
        return dict(position="learned")
    scaling = (
        a.rope_scaling_factor,
        a.rope_scaling_low_freq_factor,
        a.rope_scaling_high_freq_factor,
        a.rope_scaling_original_max_position_embeddings,
    )
    return dict(
        position="rope",
        rope_theta=a.rotary_base,
        rotary_percent=a.rotary_percent,
        rope_scaling=scaling if a.use_rope_scaling else None,
    )


def layout_from_args(a, world: int) -> Layout:
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    uneven = getattr(a, "pipeline_stage_layers", None)
    chunks = (
        len(uneven) // pp
        if uneven
        else (a.num_layers // pp) // a.num_layers_per_virtual_pipeline_stage
        if a.num_layers_per_virtual_pipeline_stage
        else 1
    )
    recompute = (
        (a.recompute_granularity, a.recompute_method, a.recompute_num_layers)
        if a.recompute_granularity
        else None
    )
    dp, _ = batch_geometry(a, world)
    return Layout(
        tp,
        pp,
        chunks,
        dp,
        a.sequence_parallel,
        a.pipeline_schedule,
        recompute,
        recompute_modules=tuple(a.recompute_modules or ("core_attn",)),
        sharding=fsdp_flags.sharding(a),
        micro_batch_size=a.micro_batch_size,
        ep=a.expert_model_parallel_size,
        etp=a.expert_tensor_parallel_size,
        cp=a.context_parallel_size,
        cp_comm_type=context_flags.comm_type(a),
        cp_a2a=context_flags.a2a_level(a),
        stage_layers=uneven,
        dp_outer=a.num_distributed_optimizer_instances,
    )


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch at each point of the run: constant, Megatron's linear ramp-up (START
    INCREMENT SAMPLES), or its step schedule ((first sample, batch) pairs)."""

    final: int
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None

    def __call__(self, consumed: int) -> int:
        return global_batch_size(consumed, self.final, self.rampup, self.steps)

    @property
    def varies(self) -> bool:
        return self.rampup is not None or self.steps is not None


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int
    batch: BatchSchedule
    lr: optim.LRSchedule
    decoupled_lr: optim.LRSchedule | None
    weight_decay: optim.WeightDecaySchedule
    # the schedules count samples (else iterations) of successful updates
    schedules_in_samples: bool
    clip_grad: float
    optimizer: OptimizerConfig
    seed: int
    per_token_loss: bool
    # Megatron's --check-for-nan-in-loss-and-grad: stop at a non-finite loss or gradient
    check_for_nan: bool
    eval_interval: int | None
    eval_iters: int
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_signal_handler: bool
    # the signal's name: SIGTERM (Megatron's default), SIGINT, SIGUSR1, SIGUSR2
    exit_signal: str
    dropout: bool
    # --deterministic-mode: the step's sums over data parallelism exact (StepSettings)
    deterministic: bool = False


@dataclass(frozen=True)
class PrecisionConfig:
    compute_dtype: torch.dtype
    # Megatron's: fp32 (bf16's default), bf16 (--grad-reduce-in-bf16), fp16 (fp16's)
    grad_dtype: torch.dtype
    # the loss scaler a fresh run starts with (fp16, or a static --loss-scale)
    scaler: loss_scale.LossScale | None
    # Adam's (precision-aware)
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    # which layers' GEMMs run in FP8, and how (fmeg.fp8.plan.Fp8Plan; None: none)
    fp8: Fp8Plan | None = None

    @property
    def name(self) -> str:
        return str(self.compute_dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] | None
    mock: bool
    split: str
    seq_length: int
    eod_mask_loss: bool
    cache_path: str | None
    # positions restart after each end of document (megatron-core's GPTDataset)
    reset_position_ids: bool = False
    # each packed document attends to itself only (cu_seqlens in the batch)
    reset_attention_mask: bool = False
    # JSONL conversations trained on their answers (fmeg.data.sft_dataset)
    sft: bool = False
    # several lines' conversations in one sample
    sft_sequence_packing: bool = False
    # fill-in-the-middle samples (--fim-data)
    fim: FIMSettings | None = None
    # threads building the next iteration's samples (fmeg.training.sample_loader)
    num_workers: int = 2


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None
    save_interval: int | None
    load: str | None
    finetune: bool
    no_load_optim: bool
    keep_last: int | None
    exit_on_missing_checkpoint: bool
    # write in the background (--async-save)
    async_save: bool = False
    # replicas share the writing of what they hold alike
    fully_parallel_save: bool = True
    # replicas share the reading of what they hold alike, then exchange it
    fully_parallel_load: bool = False
    # write the weights only (--no-save-optim)
    no_save_optim: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    log_params_norm: bool
    log_dir: str | None
    tensorboard_dir: str | None
    wandb_project: str | None
    wandb_exp_name: str | None
    wandb_save_dir: str | None
    wandb_entity: str | None
    logging_level: int | None
    # each MoE layer's balance losses into the sinks (not the log line)
    moe_per_layer_logging: bool = False


@dataclass(frozen=True)
class RuntimeConfig:
    # auto | cpu | cuda
    device: str
    # None: compile on CUDA only
    compile: bool | None
    distributed_timeout_minutes: float
    overlap_grad_reduce: bool
    ddp_bucket_size: int | None
    # which gathered units are freed after forward: true | false | auto
    reshard_after_forward: str = "true"


@dataclass(frozen=True)
class RunConfig:
    model: gpt.GPTConfig
    layout: Layout
    training: TrainingConfig
    precision: PrecisionConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    runtime: RuntimeConfig
    world: int
    # the flags as given, for the checkpoint's metadata
    arguments: tuple[tuple[str, Any], ...]
    # "--flag: why" for accepted-but-ignored Megatron flags
    ignored: tuple[str, ...]
    # where a flag was adjusted, as Megatron adjusts it
    notices: tuple[str, ...]

    @classmethod
    def from_args(cls, a, world: int, vocab_size: int) -> RunConfig:
        """The configuration of validated flags (fmeg.config.arguments.validate) for a tokenizer
        of vocab_size ids on world ranks."""
        return cls(
            model=model_config(a, vocab_size),
            layout=layout_from_args(a, world),
            training=_training(a, world),
            precision=_precision(a),
            data=DataConfig(
                tuple(a.data_path) if a.data_path else None,
                a.mock_data,
                a.split,
                a.seq_length,
                a.eod_mask_loss,
                a.data_cache_path,
                a.reset_position_ids or a.sft,
                a.reset_attention_mask or a.sft,
                a.sft,
                a.sft_sequence_packing,
                fim_settings(a),
                a.num_workers,
            ),
            checkpoint=CheckpointConfig(
                a.save,
                a.save_interval,
                a.load,
                a.finetune,
                a.no_load_optim,
                a.keep_last,
                a.exit_on_missing_checkpoint,
                a.async_save,
                a.ckpt_fully_parallel_save,
                a.ckpt_fully_parallel_load,
                a.no_save_optim,
            ),
            logging=LoggingConfig(
                a.log_interval,
                a.log_params_norm,
                a.log_dir,
                a.tensorboard_dir,
                a.wandb_project or None,
                a.wandb_exp_name or None,
                a.wandb_save_dir or None,
                a.wandb_entity or None,
                a.logging_level,
                a.moe_per_layer_logging,
            ),
            runtime=RuntimeConfig(
                a.device,
                a.compile,
                a.distributed_timeout_minutes,
                a.overlap_grad_reduce,
                a.ddp_bucket_size,
                fsdp_flags.reshard_after_forward(a),
            ),
            world=world,
            arguments=tuple(
                (k, v)
                for k, v in vars(a).items()
                if isinstance(v, (int, float, str, bool, list, type(None)))
            ),
            ignored=tuple(ignored_flags(a)),
            notices=tuple(a.notices),
        )

    @property
    def global_batch(self) -> int:
        return self.training.batch.final

    def with_changes(self, **groups) -> RunConfig:
        """A copy with whole groups or fields of groups replaced:
        with_changes(training={"train_iters": 5})."""
        return dataclasses.replace(
            self,
            **{
                k: dataclasses.replace(getattr(self, k), **v) if isinstance(v, dict) else v
                for k, v in groups.items()
            },
        )


def fim_settings(a) -> FIMSettings | None:
    """The --fim-* flags, under --fim-data."""
    if not a.fim_data:
        return None
    return FIMSettings(
        a.fim_rate,
        a.fim_spm_rate,
        a.fim_split_sample,
        a.fim_fragment_rate,
        a.fim_no_prefix,
        a.fim_prefix_token,
        a.fim_middle_token,
        a.fim_suffix_token,
        a.fim_pad_token,
        a.fim_eod_token,
    )


def _training(a, world: int) -> TrainingConfig:
    _, gbs = batch_geometry(a, world)
    steps = (
        parse_step_schedule(a.step_batch_size_schedule, a.seq_length)
        if a.step_batch_size_schedule
        else None
    )
    batch = BatchSchedule(
        steps[-1][1] if steps else gbs,
        tuple(a.rampup_batch_size) if a.rampup_batch_size else None,
        steps,
    )
    warmup, decay, in_samples = lr_steps(a)
    lr = optim.LRSchedule(
        max_lr=a.lr,
        min_lr=a.min_lr,
        warmup_steps=warmup,
        decay_steps=decay,
        style=a.lr_decay_style,
        init_lr=a.lr_warmup_init,
    )
    decoupled = (
        None
        if a.decoupled_lr is None
        else dataclasses.replace(
            lr,
            max_lr=a.decoupled_lr,
            min_lr=a.min_lr if a.decoupled_min_lr is None else a.decoupled_min_lr,
        )
    )
    weight_decay = optim.WeightDecaySchedule(
        start=a.weight_decay if a.start_weight_decay is None else a.start_weight_decay,
        end=a.weight_decay if a.end_weight_decay is None else a.end_weight_decay,
        incr_steps=(a.train_samples or a.train_iters * batch.final)
        if in_samples
        else a.train_iters,
        style=a.weight_decay_incr_style,
    )
    return TrainingConfig(
        train_iters=a.train_iters,
        batch=batch,
        lr=lr,
        decoupled_lr=decoupled,
        weight_decay=weight_decay,
        schedules_in_samples=in_samples,
        clip_grad=a.clip_grad,
        optimizer=optimizer_config(a, (a.adam_beta1, a.adam_beta2, a.adam_eps)),
        seed=a.seed,
        per_token_loss=a.calculate_per_token_loss,
        check_for_nan=a.check_for_nan_in_loss_and_grad or a.fail_on_nan,
        eval_interval=a.eval_interval if a.eval_interval and a.eval_iters else None,
        eval_iters=a.eval_iters,
        exit_interval=a.exit_interval,
        exit_duration_in_mins=a.exit_duration_in_mins,
        exit_signal_handler=a.exit_signal_handler,
        exit_signal=a.exit_signal,
        dropout=bool(a.hidden_dropout or a.attention_dropout),
        deterministic=a.deterministic_mode,
    )


def _precision(a) -> PrecisionConfig:
    compute = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    grad = (
        torch.bfloat16
        if a.grad_reduce_in_bf16
        else torch.float16
        if a.fp16 and not a.accumulate_allreduce_grads_in_fp32
        else torch.float32
    )
    # Megatron's constant scaler (fp32 has none)
    if a.loss_scale is not None and (a.fp16 or a.bf16):
        scaler = loss_scale.static(a.loss_scale)
    elif a.fp16:
        scaler = loss_scale.initial(
            a.initial_loss_scale, a.min_loss_scale, a.loss_scale_window, a.hysteresis
        )
    else:
        scaler = None
    moments = (
        tuple(MOMENT_DTYPES[d] for d in (a.exp_avg_dtype, a.exp_avg_sq_dtype))
        if a.use_precision_aware_optimizer
        else (torch.float32, torch.float32)
    )
    return PrecisionConfig(compute, grad, scaler, moments, fp8_flags.plan(a))


# what fmeg's precision-aware optimizer stores
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
