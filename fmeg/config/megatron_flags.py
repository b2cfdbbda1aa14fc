"""Megatron's flags as Megatron reads them: what it adjusts and goes on with, which activation its
flags select, and the flags that pick a kernel, an implementation or a memory policy (accepted,
named at start as ignored, because they cannot change a number).
"""

from __future__ import annotations

import argparse

from fmeg.config.declare import group
from fmeg.config.parallel_flags import compile_asked

# Megatron flags that choose a kernel or an implementation, not the model or the numbers: accepted
# so that Megatron scripts run unchanged, and named once at start as ignored, with the reason.
IGNORED_SWITCHES = {
    "--use-flash-attn": "attention runs torch's scaled_dot_product_attention, which picks its own "
    "kernel",
    "--attention-softmax-in-fp32": "fmeg has no reduced-precision softmax option; SDPA picks its "
    "kernel",
    "--no-masked-softmax-fusion": "fmeg fuses no kernels by hand",
    "--no-gradient-accumulation-fusion": "fmeg fuses no kernels by hand",
    "--no-bias-swiglu-fusion": "fmeg fuses no kernels by hand",
    "--no-bias-dropout-fusion": "fmeg fuses no kernels by hand",
    "--no-rope-fusion": "fmeg fuses no kernels by hand",
    "--no-persist-layer-norm": "fmeg fuses no kernels by hand",
    "--use-mcore-models": "fmeg has one model implementation",
    "--use-cpu-initialization": "parameters are always initialised as on one device, then sharded",
    "--no-load-rng": "dropout is counter-based (seed, iteration, position): checkpoints hold no "
    "RNG state",
    "--no-save-rng": "dropout is counter-based (seed, iteration, position): checkpoints hold no "
    "RNG state",
    "--log-throughput": "the log line always shows throughput",
    "--manual-gc": "a memory-management policy: fmeg leaves Python's garbage collector alone",
    "--overlap-param-gather": "an overlap policy: the distributed optimizer all-gathers right "
    "after its step, and sharded weights always gather the next layer during the current one",
    "--cross-entropy-loss-fusion": "the output projection and the loss are always one fused op",
    "--no-mmap-bin-files": "a memory policy: .bin files are always memory-mapped",
    "--profile": "fmeg has no built-in profiler; wrap the run in torch.profiler or nsys",
    "--no-create-attention-mask-in-dataloader": "attention is causal inside the kernel: no mask is "
    "ever built",
}
IGNORED_SETTINGS = {
    "--transformer-impl": "fmeg has one transformer implementation",
    "--manual-gc-interval": "a memory-management policy: fmeg leaves Python's garbage collector "
    "alone",
    "--distributed-backend": "the backend follows --device: NCCL on CUDA, gloo on CPU",
    "--timing-log-level": "the per-phase timers are always printed",
    "--attention-backend": "attention runs torch's scaled_dot_product_attention, which picks its "
    "own kernel",
    "--empty-unused-memory-level": "a memory policy: fmeg never empties torch's allocator cache",
    "--profile-step-start": "fmeg has no built-in profiler",
    "--profile-step-end": "fmeg has no built-in profiler",
    "--profile-ranks": "fmeg has no built-in profiler",
    "--ckpt-format": "fmeg writes sharded safetensors that any layout can load (as torch_dist "
    "does), whatever the format",
}
# Logging, checkpoint-policy and kernel switches that Megatron's functional-test configurations
# pass: accepted and named as ignored, each with the reason (none of them changes a number fmeg
# computes).
_TB = (
    "fmeg writes its fixed set of scalars (loss, grad norm, lr, loss scale, throughput) to every "
    "sink"
)
_CKPT = "fmeg writes one sharded format that any layout loads, the optimizer state included"
IGNORED_SWITCHES.update(
    {
        "--log-num-zeros-in-grad": "fmeg does not count zero gradients",
        "--log-timers-to-tensorboard": _TB,
        "--log-validation-ppl-to-tensorboard": _TB,
        "--log-memory-to-tensorboard": _TB,
        "--log-world-size-to-tensorboard": _TB,
        "--no-log-loss-scale-to-tensorboard": _TB,
        "--log-progress": "the log line and metrics.jsonl carry the progress",
        "--log-energy": "fmeg does not read energy counters",
        "--no-barrier-with-level-1-timing": "fmeg's timers take no barriers",
        "--log-straggler": "fmeg has no straggler detector",
        "--disable-straggler-on-startup": "fmeg has no straggler detector",
        "--no-one-logger": "fmeg has no one_logger",
        "--one-logger-async": "fmeg has no one_logger",
        "--enable-ft-package": "fmeg has no fault-tolerance package",
        "--calc-ft-timeouts": "fmeg has no fault-tolerance package",
        "--ckpt-assume-constant-structure": "fmeg lists each rank's placements once per run",
        "--use-persistent-ckpt-worker": "--async-save writes on a thread each rank starts once",
        "--auto-detect-ckpt-format": _CKPT,
        "--use-dist-ckpt": _CKPT,
        "--dist-ckpt-save-pre-mcore-014": _CKPT,
        "--dist-ckpt-optim-fully-reshardable": _CKPT,
        "--distrib-optim-fully-reshardable-mem-efficient": _CKPT,
        "--use-checkpoint-opt_param-scheduler": "the schedules' position always comes from the "
        "checkpoint, their shape from the flags",
        "--check-for-spiky-loss": "fmeg's NaN check covers non-finite values only",
        "--check-for-large-grads": "fmeg's NaN check covers non-finite values only",
        "--no-async-tensor-model-parallel-allreduce": "an overlap policy of Megatron's kernels",
        "--tp-comm-overlap": "an overlap policy of Transformer Engine's kernels",
        "--overlap-param-gather-with-optimizer-step": "an overlap policy: the distributed "
        "optimizer all-gathers right after its step",
        "--no-align-grad-reduce": "an overlap policy",
        "--no-align-param-gather": "an overlap policy",
        "--disable-bf16-reduced-precision-matmul": "a kernel precision policy "
        "(torch.backends.cuda.matmul)",
        "--record-memory-history": "fmeg has no built-in memory profiler",
        "--use-pytorch-profiler": "fmeg has no built-in profiler; wrap the run in torch.profiler",
        "--run-workload-inspector-server": "fmeg has no workload inspector",
        "--enable-experimental": "Megatron's switch for its experimental code paths; fmeg keeps "
        "none behind a switch",
    }
)
IGNORED_SETTINGS.update(
    {
        "--tensorboard-log-interval": "every iteration's scalars are written",
        "--tensorboard-queue-size": _TB,
        "--timing-log-option": "the timers are this rank's",
        "--one-logger-project": "fmeg has no one_logger",
        "--one-logger-run-name": "fmeg has no one_logger",
        "--app-tag-run-name": "fmeg has no one_logger",
        "--app-tag-run-version": "fmeg has no one_logger",
        "--config-logger-dir": "checkpoints record the arguments",
        "--straggler-ctrlr-port": "fmeg has no straggler detector",
        "--straggler-minmax-count": "fmeg has no straggler detector",
        "--dist-ckpt-strictness": _CKPT,
        "--non-persistent-save-interval": "fmeg writes persistent checkpoints only",
        "--non-persistent-ckpt-type": "fmeg writes persistent checkpoints only",
        "--non-persistent-global-ckpt-dir": "fmeg writes persistent checkpoints only",
        "--non-persistent-local-ckpt-dir": "fmeg writes persistent checkpoints only",
        "--non-persistent-local-ckpt-algo": "fmeg writes persistent checkpoints only",
        "--save-retain-interval": "fmeg keeps every checkpoint unless --keep-last",
        "--num-dataset-builder-threads": "datasets are built by one thread from memory-mapped "
        "files",
        "--check-weight-hash-across-dp-replicas-interval": "data-parallel replicas are bitwise "
        "equal by construction",
        "--nccl-communicator-config-path": "fmeg's NCCL groups take torch's defaults",
        "--memory-snapshot-path": "fmeg has no built-in memory profiler",
        "--rerun-mode": "fmeg has no rerun state machine",
        "--cross-entropy-fusion-impl": "picks the fused loss's kernel; fmeg's output projection "
        "and loss are one op",
        "--result-rejected-tracker-filename": "fmeg has no rerun state machine",
    }
)
# The flags of Megatron-LM main's GPT functional-test configurations and example scripts (issue 49's
# walk of them, tests/interop/megatron/test_megatron_flag_sets.py) that choose a kernel, an overlap,
# a memory or a checkpoint-writing policy, or a rank order: none changes a number fmeg computes.
_OVERLAP = "an overlap policy of Megatron's kernels"
_GRAPHS = "fmeg captures no CUDA graphs by hand (torch.compile decides)"
_FSDP_BUFFERS = "a buffer and NCCL-registration policy of Megatron-FSDP"
IGNORED_SWITCHES.update(
    {
        "--apply-query-key-layer-scaling": "divides q.k by the layer number and the softmax "
        "multiplies it back: the same softmax (a guard against fp16 overflow in Megatron's fused "
        "kernel)",
        "--ddp-average-in-collective": "where the data-parallel mean is divided (in the collective "
        "or before it): the same mean",
        "--defer-embedding-wgrad-compute": _OVERLAP,
        "--delay-wgrad-compute": _OVERLAP,
        "--overlap-p2p-communication-warmup-flush": _OVERLAP,
        "--overlap-moe-expert-parallel-comm": _OVERLAP,
        "--disable-gloo-process-groups": "fmeg creates only the process groups it uses (gloo ones "
        "only on CPU)",
        "--te-rng-tracker": "Transformer Engine's RNG tracker: fmeg's dropout is counter-based",
        "--test-mode": "Megatron's extra self-checks of its functional tests",
        "--use-transformer-engine-op-fuser": "fmeg fuses no kernels by hand",
        "--fine-grained-activation-offloading": "a memory policy: activations stay on the device "
        "(--recompute-* trades memory for compute instead)",
        "--async-ckpt-use-cpu-shm": "--async-save writes from its own copy in host memory",
        "--verify-integrity": "fmeg always checks each checkpoint cell's crc32 as it reads it",
        "--override-opt_param-scheduler": "the schedules' shape always comes from the flags, as "
        "this flag asks",
        "--use-tp-pp-dp-mapping": "a rank order for Megatron's topology; fmeg keeps "
        "tp-cp-ep-dp-pp, and the loss does not depend on the order",
        "--fsdp-manual-registration": _FSDP_BUFFERS,
        "--fsdp-db-use-persist-buf-on-alloc-fail": _FSDP_BUFFERS,
        "--megatron-fsdp-max-pool-double-buffer": _FSDP_BUFFERS,
    }
)
IGNORED_SETTINGS.update(
    {
        "--async-strategy": "--async-save writes on a thread each rank starts once",
        "--cuda-graph-impl": _GRAPHS,
        "--cuda-graph-modules": _GRAPHS,
        "--cuda-graph-warmup-steps": _GRAPHS,
        "--tp-comm-overlap-cfg": "an overlap policy of Transformer Engine's kernels",
        "--wgrad-deferral-limit": _OVERLAP,
        "--microbatch-group-size-per-virtual-pipeline-stage": "how many microbatches the "
        "interleaved schedule runs on a virtual stage in a row: an order, the same numbers",
        "--offload-modules": "a memory policy: activations stay on the device",
        "--error-injection-rate": "fmeg has no rerun state machine (these inject faults to test "
        "it)",
        "--error-injection-type": "fmeg has no rerun state machine (these inject faults to test "
        "it)",
    }
)
MULTI_VALUED = {"--profile-ranks", "--cuda-graph-modules", "--offload-modules"}
# settings of features still to come, which the feature's own flag (LATER_WORK) refuses
IGNORED_SWITCHES["--no-use-layer-wise-param-layout"] = (
    "how Megatron's layer-wise optimizer lays out its buffers: fmeg's flat state has one layout"
)
IGNORED_SETTINGS["--mup-base-hidden-size"] = "has no effect without --use-mup (fmeg has no muP yet)"
_VARIANT = (
    "has no effect without --experimental-attention-variant (fmeg has no gated delta net or "
    "sparse attention yet)"
)
IGNORED_SETTINGS.update(
    {
        flag: _VARIANT
        for flag in (
            "--linear-attention-freq",
            "--linear-conv-kernel-dim",
            "--linear-key-head-dim",
            "--linear-num-key-heads",
            "--linear-num-value-heads",
            "--linear-value-head-dim",
            "--dsa-indexer-head-dim",
            "--dsa-indexer-loss-coeff",
            "--dsa-indexer-n-heads",
            "--dsa-indexer-topk",
        )
    }
)

# Megatron flags of features fmeg does not have yet: {flag: (argparse keywords, the values that mean
# "off", the feature)}. The "off" values run; any other stops the run with one line naming the
# feature.
LATER_WORK = {
    "--rotary-interleaved": (
        {"action": "store_true"},
        (False,),
        "interleaved rotary embeddings (Llama 4's)",
    ),
    "--is-hybrid-model": ({"action": "store_true"}, (False,), "hybrid Mamba models (Nemotron-H)"),
    "--hybrid-override-pattern": ({"default": None}, (None,), "hybrid Mamba models (Nemotron-H)"),
    "--use-mup": ({"action": "store_true"}, (False,), "muP (maximal update parametrisation)"),
    "--experimental-attention-variant": (
        {"default": None},
        (None,),
        "Megatron's experimental attention (gated delta net, sparse attention)",
    ),
    "--attention-output-gate": (
        {"action": "store_true"},
        (False,),
        "a gate on attention's output (Qwen3-Next's)",
    ),
    "--apply-wd-to-qk-layernorm": (
        {"action": "store_true"},
        (False,),
        "weight decay on the q/k norms",
    ),
    "--per-split-data-args-path": (
        {"default": None},
        (None,),
        "a data path per split (--train-data-path ...)",
    ),
}
# The Mamba layers' sizes: they mean something only in a hybrid model, which --is-hybrid-model
# refuses.
IGNORED_SETTINGS.update(
    {
        flag: "has no effect without --is-hybrid-model (fmeg has no Mamba layers yet)"
        for flag in (
            "--mamba-head-dim",
            "--mamba-num-heads",
            "--mamba-num-groups",
            "--mamba-state-dim",
        )
    }
)


def _later_help(off: tuple) -> str:
    return "leave it out" if off[-1] in (None, False) else f"{off[-1]} only"


@group("Megatron features fmeg does not have yet (their 'off' value only)")
class LaterWorkFlags:
    """Megatron's flags of features fmeg does not have yet, accepted at their 'off' values."""

    ACCEPTED = {
        flag: dict(**keywords, help=f"{feature}: not in fmeg yet; {_later_help(off)}")
        for flag, (keywords, off, feature) in LATER_WORK.items()
    }


@group("accepted from Megatron scripts and ignored (named at start)")
class IgnoredFlags:
    """Megatron's flags that choose what fmeg does not choose: accepted, named as ignored."""

    ACCEPTED = {
        **{flag: dict(action="store_true", help=argparse.SUPPRESS) for flag in IGNORED_SWITCHES},
        **{
            flag: dict(
                default=None, nargs="*" if flag in MULTI_VALUED else None, help=argparse.SUPPRESS
            )
            for flag in IGNORED_SETTINGS
        },
    }


def later_work_problems(a: argparse.Namespace) -> list[str]:
    """One line for each flag that asks for a feature fmeg does not have yet."""
    problems = []
    for flag, (_, off, feature) in LATER_WORK.items():
        value = getattr(a, flag.lstrip("-").replace("-", "_"))
        if value not in off:
            given = flag if value is True else f"{flag} {value}"
            fix = "drop the flag" if off[-1] in (None, False) else f"use {off[-1]} or drop the flag"
            problems.append(f"{given}: {feature} is not supported by fmeg yet; {fix}")
    return problems


def ignored_flags(a: argparse.Namespace) -> list[str]:
    """'--flag: why' for each accepted-but-ignored Megatron flag that was given."""
    from fmeg.config import fsdp_flags, mla_flags, modelopt_flags, moe_flags

    given = {**IGNORED_SWITCHES, **IGNORED_SETTINGS}
    return (
        [
            f"{flag}: {why}"
            for flag, why in given.items()
            if getattr(a, flag.lstrip("-").replace("-", "_")) not in (None, False)
        ]
        + moe_flags.ignored(a)
        + fsdp_flags.ignored(a)
        + modelopt_flags.ignored(a)
        + mla_flags.ignored(a)
    )


def activation(a: argparse.Namespace) -> str:
    """Megatron's MLP activation for the flags: SwiGLU, quick-GEGLU; else GELU with the tanh
    approximation (--openai-gelu, or the default fused bias-GELU, which needs biases); else exact
    GELU."""
    if a.swiglu:
        return "swiglu"
    if a.quick_geglu:
        return "quick_geglu"
    if a.squared_relu:
        return "squared_relu"
    fused_bias_gelu = not a.no_bias_gelu_fusion and not a.disable_bias_linear
    return "gelu_tanh" if a.openai_gelu or fused_bias_gelu else "gelu"


def megatron_leniencies(a: argparse.Namespace) -> list[str]:
    """Where Megatron adjusts a flag and goes on, do the same (in place) and return one warning line
    for each adjustment a user should hear about."""
    notices = []
    if a.recompute_activations:
        # as Megatron reads --recompute-activations
        a.recompute_granularity = "selective"
    # Megatron's deprecated spelling, read as it reads it
    if a.moe_layer_recompute:
        a.recompute_granularity = "selective"
        a.recompute_modules = [*(a.recompute_modules or ["core_attn"]), "moe"]
        notices.append(
            "--moe-layer-recompute is deprecated (as in Megatron): read as "
            f"--recompute-granularity selective --recompute-modules {' '.join(a.recompute_modules)}"
        )
    if a.group_query_attention and a.num_query_groups is None:
        # Megatron's default with the switch on
        a.num_query_groups = 1
    elif not a.group_query_attention and a.num_query_groups is not None:
        notices.append(
            f"--num-query-groups {a.num_query_groups} has no effect without "
            "--group-query-attention (as in Megatron): multi-head attention"
        )
        a.num_query_groups = None
    if a.deterministic_mode:
        notices += _deterministic_leniencies(a)
    if a.sequence_parallel and a.tensor_model_parallel_size == 1:
        notices.append(
            "--sequence-parallel is off: it needs --tensor-model-parallel-size > 1 (as in Megatron)"
        )
        a.sequence_parallel = False
    if a.save_interval is not None and a.save is None:
        notices.append(
            f"--save-interval {a.save_interval} has no effect without --save DIR: no checkpoints"
        )
    if a.async_save and a.save is None:
        notices.append("--async-save has no effect without --save DIR")
    # a restarted job loads from --save
    if a.ckpt_fully_parallel_load and a.load is None and a.save is None:
        notices.append("--ckpt-fully-parallel-load has no effect without --load DIR")
    for flag in ("no_load_optim", "finetune", "use_checkpoint_args"):
        if getattr(a, flag) and a.load is None:
            notices.append(f"--{flag.replace('_', '-')} has no effect without --load DIR")
    return notices + _precision_data_and_schedule_leniencies(a)


def _deterministic_leniencies(a: argparse.Namespace) -> list[str]:
    """--deterministic-mode's sums not yet exact in this run: by parallelism, and by the layers
    whose replicated weights meet split tokens under tensor parallelism."""
    others = _named(
        ("pipeline", a.pipeline_model_parallel_size > 1),
        ("context", a.context_parallel_size > 1),
        ("expert", a.expert_model_parallel_size > 1),
    )
    under_tp = a.tensor_model_parallel_size > 1
    layers = _named(
        ("mixture-of-experts", under_tp and bool(a.num_experts)),
        ("multi-latent attention", under_tp and bool(a.multi_latent_attention)),
        ("FP8", under_tp and bool(a.fp8)),
    )
    eager = (
        ["--deterministic-mode runs the stages eagerly: its exact sums are not compiled yet"]
        if compile_asked(a)
        else []
    )
    if not others and not layers:
        return eager
    what = [f"{', '.join(others)} parallelism"] if others else []
    what += [f"{', '.join(layers)} layers under tensor parallelism"] if layers else []
    return eager + [
        "--deterministic-mode: the sums over data, tensor and sequence parallelism are exact; "
        f"those of {' and '.join(what)} are not yet (the curve is within rounding of one rank's, "
        "not its bits)"
    ]


def _named(*pairs: tuple[str, bool]) -> list[str]:
    return [name for name, used in pairs if used]


def _precision_data_and_schedule_leniencies(a: argparse.Namespace) -> list[str]:
    """megatron_leniencies' part for precision, data, tokenizers and schedules."""
    notices = []
    if a.grad_reduce_in_bf16 and not a.bf16:
        notices.append(
            "--grad-reduce-in-bf16 has no effect without --bf16 (as in Megatron): gradients are "
            "reduced in fp32"
        )
        a.grad_reduce_in_bf16 = False
    if a.eval_interval is not None and a.eval_iters == 0:
        notices.append("--eval-iters 0: no validation")
    if a.sft and a.sft_tokenizer_prompt_format == "default":
        notices.append(
            "--sft-tokenizer-prompt-format default: the loss counts the answers only, as with "
            "every format (Megatron's default format counts every token of the conversation)"
        )
    if a.sft and a.eod_mask_loss:
        notices.append(
            "--eod-mask-loss has no effect with --sft: the loss counts the answers and each "
            "conversation's closing end of document"
        )
    if a.tokenizer_type is None:
        a.tokenizer_type = "GPT2BPETokenizer" if a.vocab_file and a.merge_file else "ByteTokenizer"
    if a.vocab_size is not None and a.tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        notices.append(
            f"--vocab-size {a.vocab_size} has no effect with --tokenizer-type {a.tokenizer_type} "
            "(as in Megatron): the tokenizer's vocabulary is used"
        )
    if a.rampup_batch_size:
        notices.append(
            "--rampup-batch-size is deprecated and ignored by current Megatron (which takes "
            "--step-batch-size-schedule); fmeg still ramps the batch up as older Megatron did"
        )
    if a.step_batch_size_schedule and a.global_batch_size is not None:
        notices.append(
            f"--global-batch-size {a.global_batch_size} is ignored with --step-batch-size-schedule "
            "(as in Megatron): its last batch size is the final one"
        )
    if a.lr_warmup_samples == 0 and a.train_samples is None and a.lr_decay_samples is None:
        # Megatron's default value: iteration-based training takes it
        a.lr_warmup_samples = None
    if a.loss_scale is not None and not (a.fp16 or a.bf16):
        notices.append(
            f"--loss-scale {a.loss_scale:g} has no effect without --fp16 or --bf16 (as in Megatron)"
        )
    if a.exit_on_missing_checkpoint and a.load is None:
        notices.append("--exit-on-missing-checkpoint has no effect without --load DIR")
    if a.use_rotary_position_embeddings:
        a.position_embedding_type = "rope"
    # scripts' nested quoting ("'99,1,0'") reaches us literally
    a.split = a.split.strip().strip("'\"")
    return notices
