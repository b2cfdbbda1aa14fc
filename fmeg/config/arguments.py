"""The pretraining runner's arguments: Megatron's flag names and parser rules, and an optional YAML
file.

    args = parse_args(["--tensor-model-parallel-size", "2", "--config", "run.yaml"])
    problems = validate(args, world_size=4)        # fmeg.config.validation: one line per problem

A YAML file holds the same settings by flag name (dashes or underscores); flags given on the command
line override it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from fmeg.cli import OneLineParser, refuse
from fmeg.data.tokenizers import TOKENIZER_TYPES
from fmeg.models.gpt_pipeline import SELECTIVE_MODULES
from fmeg.config.batch_schedule import iterations_for, parse_step_schedule
from fmeg.config import pipeline_layout
from fmeg.config import (
    context_flags,
    fsdp_flags,
    gpt_oss_flags,
    mla_flags,
    modelopt_flags,
    moe_flags,
    mtp_flags,
)
from fmeg.config.megatron_flags import (
    IGNORED_SETTINGS,
    IGNORED_SWITCHES,
    LATER_WORK,
    MULTI_VALUED,
    megatron_leniencies,
)


def batch_geometry(a: argparse.Namespace, world_size: int) -> tuple[int, int]:
    """(data-parallel size, final global batch): dp = world / (tp * pp * cp) (at least 1), and the
    global batch defaults to one micro batch per data-parallel rank."""
    cp = max(1, getattr(a, "context_parallel_size", 1))
    dp = max(1, world_size // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size * cp))
    # its last batch is the final one, as in Megatron
    if getattr(a, "step_batch_size_schedule", None):
        try:
            return dp, parse_step_schedule(a.step_batch_size_schedule, max(a.seq_length, 1))[-1][1]
        except ValueError:
            pass  # validate() names the problem
    return dp, a.global_batch_size or a.micro_batch_size * dp


def _parallelism_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's flags for the layout over ranks."""
    g = p.add_argument_group("parallelism")
    _layout_flags(g)
    _overlap_recompute_compile_flags(g)


def _layout_flags(g: Any) -> None:
    """Megatron's flags for the layout over ranks and the device."""
    g.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="ranks that split each layer's matrices (Megatron's tensor parallelism)",
    )
    g.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="the ranks left over by tensor and pipeline parallelism are data parallel",
    )
    g.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="layers in each virtual stage: interleaved 1F1B over several chunks a rank",
    )
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="N virtual stages per pipeline rank (sets --num-layers-per-virtual-pipeline-stage)",
    )
    g.add_argument(
        "--pipeline-model-parallel-layout",
        default=None,
        help="Megatron's layout string, e.g. 'Et|(tt|)*3tmL': what each (virtual) stage holds; "
        "fmeg takes the even ones (fmeg.config.pipeline_layout)",
    )
    g.add_argument(
        "--pipeline-schedule",
        default="1f1b",
        choices=["1f1b", "gpipe", "zero_bubble"],
        help="schedule without virtual stages (interleaved 1F1B is used with them)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the norms' and dropouts' activations over the tensor-parallel ranks along the "
        "sequence",
    )
    g.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="ZeRO-1: each data-parallel rank keeps a slice of the fp32 master weights and moments",
    )
    g.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="how long a collective may wait before the job fails",
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda:LOCAL_RANK with NCCL when CUDA is available, else CPU with gloo",
    )


def _overlap_recompute_compile_flags(g: Any) -> None:
    """Megatron's flags for overlap, recomputation and compilation."""
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="start each data-parallel gradient bucket's reduction during the backward pass",
    )
    g.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="elements per data-parallel gradient bucket (default max(40M, 1M * dp))",
    )
    g.add_argument(
        "--recompute-granularity",
        default=None,
        choices=["full", "selective"],
        help="full: recompute whole layers in backward instead of keeping their activations; "
        "selective: recompute the attention cores",
    )
    g.add_argument(
        "--recompute-method",
        default=None,
        choices=["uniform", "block"],
        help="uniform: recompute each chunk of --recompute-num-layers layers from its input; "
        "block: recompute the first --recompute-num-layers layers of each pipeline stage",
    )
    g.add_argument(
        "--recompute-num-layers",
        type=int,
        default=None,
        help="with --recompute-granularity full: layers per recomputed block (uniform) or "
        "recomputed layers per stage (block)",
    )
    g.add_argument(
        "--recompute-activations", action="store_true", help="--recompute-granularity selective"
    )
    g.add_argument(
        "--recompute-modules",
        nargs="*",
        default=None,
        choices=SELECTIVE_MODULES,
        help="with --recompute-granularity selective: the pieces of each layer run again in "
        "backward (default core_attn): core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
        "shared_experts",
    )
    g.add_argument(
        "--moe-layer-recompute",
        action="store_true",
        help="Megatron's deprecated spelling of --recompute-granularity selective "
        "--recompute-modules moe",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each pipeline stage torch.compile'd as one graph (each layer, the embedding and "
        "the loss head apart under --overlap-grad-reduce with dp > 1 or full recomputation; "
        "default: on with CUDA, off on CPU, where compiling takes longer than short runs train)",
    )


def _model_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's flags for the model."""
    m = p.add_argument_group("model")
    _model_shape_flags(m)
    _rope_and_activation_flags(m)
    _embedding_and_init_flags(m)


def _model_shape_flags(m: Any) -> None:
    """Megatron's flags for the model's shape and attention."""
    m.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    m.add_argument("--hidden-size", type=int, default=128, help="the model's width")
    m.add_argument(
        "--num-attention-heads",
        type=int,
        default=4,
        help="attention heads (query heads with grouped-query attention)",
    )
    m.add_argument(
        "--num-query-groups",
        type=int,
        default=None,
        help="key/value heads; as in Megatron, used only with --group-query-attention",
    )
    m.add_argument(
        "--group-query-attention",
        action="store_true",
        help="grouped-query attention with --num-query-groups key/value heads (default 1)",
    )
    m.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="default 4 * --hidden-size; with --swiglu, Megatron's int(8 * hidden / 3 / 64) * 64",
    )
    m.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    m.add_argument(
        "--max-position-embeddings", type=int, default=None, help="default: --seq-length"
    )
    m.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    m.add_argument(
        "--swiglu",
        action="store_true",
        help="the gated SiLU MLP (Llama's), its hidden width 2/3 of GELU's by default",
    )
    m.add_argument("--squared-relu", action="store_true", help="relu(x)^2 as the MLP's activation")
    m.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="a norm (--normalization) on each head's queries and keys before RoPE (Qwen3)",
    )
    m.add_argument(
        "--add-qkv-bias",
        action="store_true",
        help="a bias on q, k and v even with --disable-bias-linear (Qwen2.5)",
    )


def _rope_and_activation_flags(m: Any) -> None:
    """Megatron's flags for RoPE, its scaling, the activation and the norm."""
    m.add_argument(
        "--use-rope-scaling", action="store_true", help="Llama 3.1's RoPE frequency scaling"
    )
    m.add_argument(
        "--rope-scaling-factor",
        type=float,
        default=8.0,
        help="with --use-rope-scaling (Llama 3.2: 32)",
    )
    m.add_argument(
        "--rope-scaling-low-freq-factor",
        type=float,
        default=1.0,
        help="with --use-rope-scaling: HF's low_freq_factor (Megatron fixes it at 1)",
    )
    m.add_argument(
        "--rope-scaling-high-freq-factor",
        type=float,
        default=4.0,
        help="with --use-rope-scaling: HF's high_freq_factor (Megatron fixes it at 4)",
    )
    m.add_argument(
        "--rope-scaling-original-max-position-embeddings",
        type=int,
        default=8192,
        help="with --use-rope-scaling: the context the model was trained at (Megatron fixes it at "
        "8192)",
    )
    m.add_argument(
        "--openai-gelu", action="store_true", help="GELU with the tanh approximation (GPT-2's)"
    )
    m.add_argument(
        "--no-bias-gelu-fusion",
        action="store_true",
        help="exact (erf) GELU: as in Megatron, whose default fused bias-GELU is the tanh "
        "approximation (also exact with --disable-bias-linear, which turns that fusion off)",
    )
    m.add_argument(
        "--norm-epsilon", type=float, default=1e-5, help="the epsilon of LayerNorm or RMSNorm"
    )
    m.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="norm weights centred on zero: the norm scales by 1 + weight, and weights start at 0",
    )
    m.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE's base (theta)")
    m.add_argument(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="the fraction of each head that RoPE rotates",
    )


def _embedding_and_init_flags(m: Any) -> None:
    """Megatron's flags for head size, positions, embeddings, dropout and initialization."""
    m.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="the dimension of each attention head (default --hidden-size / --num-attention-heads)",
    )
    m.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
    )
    m.add_argument(
        "--no-position-embedding",
        action="store_true",
        help="no learned position embedding: with --position-embedding-type rope (which has none) "
        "a no-op",
    )
    m.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Megatron's older spelling of --position-embedding-type rope",
    )
    m.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="an output layer of its own instead of the word embedding's transpose",
    )
    m.add_argument(
        "--disable-bias-linear", action="store_true", help="no biases on the linear layers"
    )
    m.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="dropout after attention's and the MLP's output projections",
    )
    m.add_argument(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="dropout on the attention probabilities",
    )
    m.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="the standard deviation of the weights' normal initialization",
    )
    m.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this times tp",
    )
    m.add_argument(
        "--padded-vocab-size",
        type=int,
        default=None,
        help="rows of the embedding and output tables (default: the tokenizer's vocabulary padded "
        "to a multiple of --make-vocab-size-divisible-by * tp); padding rows change no number",
    )


def _training_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's flags for the steps, batches, optimizer and precision."""
    t = p.add_argument_group("training")
    _batch_flags(t)
    _schedule_flags(t)
    _precision_flags(t)


def _batch_flags(t: Any) -> None:
    """Megatron's flags for batches and the run length."""
    t.add_argument(
        "--micro-batch-size",
        type=int,
        default=4,
        help="samples a data-parallel rank runs through the model at a time",
    )
    t.add_argument(
        "--global-batch-size", type=int, default=None, help="default: micro batch * data parallel"
    )
    t.add_argument(
        "--rampup-batch-size",
        type=int,
        nargs=3,
        default=None,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT over SAMPLES samples (current Megatron "
        "ignores it and takes --step-batch-size-schedule; fmeg still ramps)",
    )
    t.add_argument(
        "--step-batch-size-schedule",
        default=None,
        metavar="'THRESHOLD:BATCH ...'",
        help="the global batch from each threshold in tokens on (K, M, B, T suffixes), e.g. "
        "'0:256 100M:512'; the last batch is the final one (--global-batch-size is ignored)",
    )
    t.add_argument(
        "--lr-warmup-samples", type=int, default=None, help="count the LR schedule in samples"
    )
    t.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="samples over which the learning rate decays (schedules in samples)",
    )
    length = t.add_mutually_exclusive_group()
    length.add_argument("--train-iters", type=int, default=None, help="default 100")
    length.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="train for this many samples instead (the LR schedule then counts samples)",
    )


def _schedule_flags(t: Any) -> None:
    """Megatron's flags for the learning-rate and weight-decay schedules, the clip and Adam."""
    t.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate")
    t.add_argument("--min-lr", type=float, default=0.0, help="the learning rate the decay ends at")
    t.add_argument(
        "--decoupled-lr",
        type=float,
        default=None,
        help="the word embedding's and output layer's peak LR (same warmup and decay)",
    )
    t.add_argument(
        "--decoupled-min-lr", type=float, default=None, help="their minimum LR (default --min-lr)"
    )
    t.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="the loss is the global batch's token losses over its token count, not a mean of "
        "microbatch means",
    )
    t.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    t.add_argument("--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup")
    t.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="the LR warmup starts from (default 0)"
    )
    t.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="warm up over this fraction of the decay steps (replaces --lr-warmup-iters/-samples)",
    )
    t.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    t.add_argument(
        "--weight-decay",
        type=float,
        default=0.01,
        help="AdamW's decoupled weight decay (not on biases and norms)",
    )
    t.add_argument("--start-weight-decay", type=float, default=None, help="default: --weight-decay")
    t.add_argument("--end-weight-decay", type=float, default=None, help="default: --weight-decay")
    t.add_argument(
        "--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"]
    )
    t.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="clip the global gradient norm to this (0: no clipping)",
    )
    t.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    t.add_argument("--adam-beta2", type=float, default=0.999, help="Adam's second-moment decay")
    t.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")
    t.add_argument(
        "--seed", type=int, default=1234, help="the seed of initialization, data order and dropout"
    )


def _precision_flags(t: Any) -> None:
    """Megatron's flags for precision and loss scaling."""
    t.add_argument(
        "--bf16", action="store_true", help="bf16 compute, fp32 main weights and gradients"
    )
    t.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="Adam's moments stored in --exp-avg-dtype and --exp-avg-sq-dtype, stepped in fp32",
    )
    for flag, choices in (
        ("--main-grads-dtype", ["fp32", "bf16"]),
        ("--main-params-dtype", ["fp32", "fp16"]),
        ("--exp-avg-dtype", ["fp32", "fp16", "bf16", "fp8"]),
        ("--exp-avg-sq-dtype", ["fp32", "fp16", "bf16", "fp8"]),
    ):
        t.add_argument(
            flag, choices=choices, default="fp32", help="with --use-precision-aware-optimizer"
        )
    t.add_argument("--fp16", action="store_true", help="fp16 compute with a dynamic loss scaler")
    t.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="with --bf16: accumulate and reduce gradients in bf16 (default fp32), as Megatron",
    )
    t.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="with --fp16: accumulate and reduce gradients in fp32 (default fp16, as Megatron); "
        "--bf16 always does unless --grad-reduce-in-bf16",
    )
    t.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        help="a static loss scale (with --fp16 or --bf16; an overflowed step is skipped); default: "
        "--fp16's dynamic scaler",
    )
    t.add_argument(
        "--initial-loss-scale",
        type=float,
        default=2.0**32,
        help="--fp16's dynamic loss scale at the start",
    )
    t.add_argument(
        "--min-loss-scale", type=float, default=1.0, help="the dynamic loss scale's floor"
    )
    t.add_argument(
        "--loss-scale-window", type=int, default=1000, help="clean steps before the scale doubles"
    )
    t.add_argument(
        "--hysteresis", type=int, default=2, help="overflowed steps before the scale halves"
    )


def _data_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's flags for the data and tokenizer."""
    d = p.add_argument_group("data")
    _dataset_flags(d)
    _sft_and_fim_flags(d)


def _dataset_flags(d: Any) -> None:
    """Megatron's flags for the dataset and tokenizer."""
    d.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="prefix, or 'weight prefix ...' (default: stdlib)",
    )
    d.add_argument(
        "--mock-data",
        action="store_true",
        help="synthetic documents (Megatron's mock dataset) instead of --data-path or the stdlib "
        "corpus",
    )
    d.add_argument(
        "--split",
        default="969,30,1",
        help="the train,valid,test weights of each dataset's documents",
    )
    d.add_argument(
        "--tokenizer-type",
        default=None,
        choices=TOKENIZER_TYPES,
        help="default: GPT2BPETokenizer with --vocab-file and --merge-file, else ByteTokenizer",
    )
    d.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's ids in all (the last is the end of document); TikTokenizer's ids in "
        "all (default 2**17)",
    )
    d.add_argument(
        "--tokenizer-model",
        help="the tokenizer's file or directory (SentencePiece model, tiktoken JSON, Hugging Face "
        "directory)",
    )
    d.add_argument(
        "--tiktoken-pattern",
        choices=["v1", "v2"],
        default=None,
        help="TikTokenizer's pre-tokenizer regex",
    )
    d.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids reserved below the vocabulary for special tokens",
    )
    d.add_argument(
        "--tiktoken-special-tokens",
        nargs="+",
        default=None,
        help="TikTokenizer's named special tokens (default <unk> <s> </s>)",
    )
    d.add_argument("--vocab-file", help="GPT2BPETokenizer's vocab.json")
    d.add_argument("--merge-file", help="GPT2BPETokenizer's merges.txt")
    d.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    d.add_argument(
        "--reset-position-ids", action="store_true", help="positions restart at each document"
    )
    d.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="tokens attend within their own document only",
    )
    d.add_argument("--data-cache-path", default=None, help="where sample indices are cached")
    d.add_argument(
        "--num-workers",
        type=int,
        default=2,
        help="threads that build the next iteration's samples while a step runs (0: build them "
        "when asked)",
    )


def _sft_and_fim_flags(d: Any) -> None:
    """Megatron's flags for fine-tuning conversations and fill-in-the-middle."""
    d.add_argument(
        "--sft",
        action="store_true",
        help='fine-tune on JSONL conversations ({"messages": [...]} lines), trained on the '
        "answers; needs --tokenizer-type SFTTokenizer --tokenizer-model HF_DIR",
    )
    d.add_argument(
        "--sft-tokenizer-prompt-format",
        default=None,
        help="SFTTokenizer's chat format: default (the directory's own chat template), "
        "nemotron-h-aligned, nemotron-nano-v2 or identity (the turns' texts joined)",
    )
    d.add_argument(
        "--fim-data",
        action="store_true",
        help="fill-in-the-middle: rearrange documents into prefix, suffix and middle (Megatron's "
        "FIM dataset)",
    )
    d.add_argument(
        "--fim-rate",
        type=float,
        default=0.5,
        help="--fim-data: the chance that a document is rearranged",
    )
    d.add_argument(
        "--fim-spm-rate",
        type=float,
        default=0.5,
        help="--fim-data: the chance that a rearranged document is laid out suffix-prefix-middle",
    )
    d.add_argument(
        "--fim-split-sample",
        default=None,
        help="--fim-data: a token that cuts a document into fragments rearranged one by one",
    )
    d.add_argument(
        "--fim-fragment-rate",
        type=float,
        default=None,
        help="--fim-split-sample: the chance that a fragment is rearranged",
    )
    d.add_argument(
        "--fim-no-prefix",
        default=None,
        help="--fim-data: leave documents whose text starts so alone",
    )
    for part, default in (
        ("prefix", "<fim_prefix>"),
        ("middle", "<fim_middle>"),
        ("suffix", "<fim_suffix>"),
        ("pad", "<fim_pad>"),
        ("eod", "<|endoftext|>"),
    ):
        d.add_argument(
            f"--fim-{part}-token", default=default, help=f"--fim-data: the tokenizer's {part} token"
        )
    d.add_argument(
        "--sft-sequence-packing",
        action="store_true",
        help="--sft: pack consecutive conversations into each sample (default: one JSONL line a "
        "sample)",
    )


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's flags for saving and loading."""
    c = p.add_argument_group("checkpoints")
    _save_load_flags(c)
    _exit_flags(c)


def _save_load_flags(c: Any) -> None:
    """Megatron's flags for saving and loading."""
    c.add_argument("--save", default=None, help="checkpoint directory")
    c.add_argument(
        "--save-interval", type=int, default=None, help="save every N iterations (and at the end)"
    )
    c.add_argument(
        "--load", default=None, help="resume from the newest checkpoint in this directory"
    )
    c.add_argument(
        "--no-load-optim",
        action="store_true",
        help="with --load: take the weights, iteration and samples, but start a fresh optimizer "
        "state",
    )
    c.add_argument(
        "--no-save-optim",
        action="store_true",
        help="write the weights only (no master weights, moments or loss scale): such a checkpoint "
        "resumes with --no-load-optim or --finetune, as Megatron's",
    )
    c.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="with --load: take the model's flags (sizes, norms, activation, positions...) from "
        "the checkpoint, as Megatron's; the run's other flags stay yours",
    )
    c.add_argument(
        "--finetune",
        action="store_true",
        help="with --load: take the weights only; iteration, samples and optimizer start afresh",
    )
    c.add_argument("--keep-last", type=int, default=None, help="keep only the newest K checkpoints")
    c.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in the background while training goes on (copied to host memory "
        "first)",
    )
    c.add_argument(
        "--ckpt-fully-parallel-save",
        dest="ckpt_fully_parallel_save",
        action="store_true",
        default=True,
        help="spread the writing of replicated tensors over their data-parallel replicas (the "
        "default, as Megatron's)",
    )
    c.add_argument(
        "--no-ckpt-fully-parallel-save",
        dest="ckpt_fully_parallel_save",
        action="store_false",
        help="write each replicated tensor from its first replica only",
    )
    c.add_argument(
        "--ckpt-fully-parallel-load",
        action="store_true",
        help="read replicated tensors once over their data-parallel replicas, which exchange them",
    )


def _exit_flags(c: Any) -> None:
    """Megatron's flags for when the run stops."""
    c.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="on --exit-signal (SIGTERM): save (with --save) and exit 0",
    )
    c.add_argument(
        "--exit-signal",
        default="SIGTERM",
        choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
        help="the signal --exit-signal-handler catches",
    )
    c.add_argument(
        "--exit-interval", type=int, default=None, help="exit after iterations divisible by N"
    )
    c.add_argument(
        "--exit-duration-in-mins", type=float, default=None, help="exit after this many minutes"
    )
    c.add_argument(
        "--check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_true",
        default=True,
        help="stop (exit 1) at a non-finite loss or gradient, as Megatron by default; with a loss "
        "scaler, at a non-finite loss or an overflow at --min-loss-scale (others it skips)",
    )
    c.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="go on past non-finite losses and gradients (counted in the log line)",
    )
    c.add_argument(
        "--fail-on-nan", action="store_true", help="fmeg's older name of the default check"
    )
    c.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="with --load: stop (exit 2) instead of starting afresh when it holds no checkpoint",
    )


def _logging_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's flags for logging and validation."""
    lg = p.add_argument_group("logging")
    lg.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="validate every N iterations (and at the end)",
    )
    lg.add_argument(
        "--eval-global-batch-size",
        type=int,
        default=None,
        help="Megatron's validation batch: the global batch (the only one fmeg takes)",
    )
    lg.add_argument("--eval-iters", type=int, default=2, help="global batches per validation")
    lg.add_argument("--log-interval", type=int, default=10, help="iterations between log lines")
    lg.add_argument(
        "--log-params-norm",
        action="store_true",
        help="add the parameters' global L2 norm to the log line and metrics",
    )
    lg.add_argument("--log-dir", default=None, help="write metrics.jsonl (and loss.png) here")
    lg.add_argument(
        "--tensorboard-dir",
        default=None,
        help="also write TensorBoard scalars here (pip install tensorboard)",
    )
    lg.add_argument(
        "--wandb-project",
        default="",
        help="also log to Weights & Biases in this project (pip install "
        "wandb; offline unless WANDB_API_KEY is set)",
    )
    lg.add_argument("--wandb-exp-name", default="", help="the W&B run's name")
    lg.add_argument(
        "--wandb-save-dir", default="", help="where W&B writes its files (default: --log-dir or .)"
    )
    lg.add_argument("--wandb-entity", default="", help="the W&B team or user")
    lg.add_argument(
        "--logging-level", type=int, default=None, help="Python logging's level (e.g. 20 for INFO)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="torchrun --nproc-per-node N -m recipes.gpt_pretrain",
        description="Pretrain a GPT with any tensor/sequence/pipeline/data layout.",
    )
    add = p.add_argument
    add("--config", help="YAML file of settings by flag name; command-line flags override it")
    _parallelism_flags(p)
    _model_flags(p)
    _training_flags(p)
    _data_flags(p)
    _checkpoint_flags(p)
    _logging_flags(p)
    moe_flags.add_arguments(p)
    mla_flags.add_arguments(p)
    mtp_flags.add_arguments(p)
    gpt_oss_flags.add_arguments(p)
    context_flags.add_arguments(p)
    fsdp_flags.add_arguments(p)
    modelopt_flags.add_arguments(p)
    later = p.add_argument_group(
        "Megatron features fmeg does not have yet (their 'off' value only)"
    )
    for flag, (keywords, off, feature) in LATER_WORK.items():
        later.add_argument(
            flag,
            **keywords,
            help=f"{feature}: not in fmeg yet; "
            f"{'leave it out' if off[-1] in (None, False) else f'{off[-1]} only'}",
        )
    ig = p.add_argument_group("accepted from Megatron scripts and ignored (named at start)")
    for flag in IGNORED_SWITCHES:
        ig.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in IGNORED_SETTINGS:
        ig.add_argument(
            flag, default=None, nargs="*" if flag in MULTI_VALUED else None, help=argparse.SUPPRESS
        )
    return p


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Flags over an optional --config YAML file, with Megatron's defaults (tp = pp = 1: every rank
    is data parallel unless told otherwise)."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    from_yaml = load_config(first.config, parser) if first.config else {}
    parser.set_defaults(**from_yaml)
    args = parser.parse_args(argv)
    # even at their default values
    args.given = tuple(sorted({*from_yaml, *_given_on_command_line(argv)}))
    if args.use_checkpoint_args and args.load:
        from fmeg.config.checkpoint_args import apply_checkpoint_args

        problem = apply_checkpoint_args(args)
        if problem:
            refuse(problem)
    world = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if args.train_samples is not None and args.train_iters is None:
        _, gbs = batch_geometry(args, world)
        ramp = tuple(args.rampup_batch_size) if args.rampup_batch_size else None
        try:
            steps = (
                parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
                if args.step_batch_size_schedule and args.seq_length > 0
                else None
            )
        except ValueError:
            steps = None  # validate() names the problem
        args.train_iters = iterations_for(args.train_samples, gbs, ramp, steps) if gbs > 0 else 0
    elif args.train_iters is None:
        args.train_iters = 100
    args.notices = megatron_leniencies(args) + moe_flags.leniencies(args)
    args.layout_problems = pipeline_layout.apply(args)  # validate() names them
    from fmeg.config.checkpoint_args import router_without_bias

    older = router_without_bias(args)
    if older:
        args.notices.append(older)
    return args


def _given_on_command_line(argv: list[str] | None) -> set[str]:
    """The destinations of the flags given on the command line (a parse in which nothing has a
    default)."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_known_args(argv)[0]))


def load_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The YAML file's settings by flag name, each typed as its flag types it (a switch takes only
    true or false, a number only a number, null nothing); any problem ends the run with one line."""
    import yaml

    if not Path(path).is_file():
        refuse(f"--config {path}: no such file")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    # syntax errors, and !!python tags safe_load refuses
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        refuse(f"--config {path}: not readable YAML ({' '.join(str(e).split())[:200]})")
    if not isinstance(data, dict):
        refuse(f"--config {path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions}
    settings = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in actions or dest in ("config", "help"):
            refuse(
                f"--config {path}: unknown setting {key!r} (use the flag's name, e.g. num-layers)"
            )
        settings[dest] = _typed(actions[dest], value, f"--config {path}: {key}")
    return settings


def _typed(action: argparse.Action, value: Any, where: str) -> Any:
    if value is None:
        refuse(f"{where} is null; give a value or leave the setting out")
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            refuse(f"{where}: {value!r} is not true or false")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        if isinstance(action.nargs, int) and len(items) != action.nargs:
            refuse(f"{where}: expected {action.nargs} values, got {value!r}")
        return [_scalar(action, item, where) for item in items]
    if isinstance(value, (list, dict)):
        refuse(f"{where}: expected one value, got {value!r}")
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type or str
    if (
        isinstance(value, bool)
        or isinstance(value, (list, dict))
        or (kind is int and isinstance(value, float) and not value.is_integer())
    ):
        refuse(f"{where}: {value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
    try:
        value = kind(value)
    except (TypeError, ValueError):
        refuse(f"{where}: {value!r} is not {'an integer' if kind is int else 'a ' + kind.__name__}")
    if action.choices is not None and value not in action.choices:
        refuse(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def lr_steps(a: argparse.Namespace) -> tuple[float, int, bool]:
    """(warmup, decay, counted_in_samples) of the learning-rate schedule, as Megatron derives them:
    in samples when --train-samples or --lr-decay-samples is given (decay defaults to
    --train-samples, warmup to 0), else in iterations; --lr-warmup-fraction is a fraction of
    decay."""
    in_samples = a.lr_decay_samples is not None or a.train_samples is not None
    if in_samples:
        decay = a.lr_decay_samples or a.train_samples
    else:
        decay = a.lr_decay_iters or a.train_iters
    if a.lr_warmup_fraction is not None:  # a fraction of a step stays a fraction, as in Megatron
        return a.lr_warmup_fraction * decay, decay, in_samples
    return ((a.lr_warmup_samples or 0) if in_samples else a.lr_warmup_iters), decay, in_samples
