"""Megatron's flags for the layout over ranks, overlap, recomputation and compilation."""

from __future__ import annotations

import argparse

import torch


from fmeg.config.declare import not_positive, flag, group, switch
from fmeg.models.gpt_pipeline import SELECTIVE_MODULES
from fmeg.parallel.pipeline.schedules import SCHEDULES


@group("parallelism")
class ParallelFlags:
    """How ranks split the model and the data, and the device."""

    tensor_model_parallel_size: int = flag(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="ranks that split each layer's matrices (Megatron's tensor parallelism)",
    )
    pipeline_model_parallel_size: int = flag(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="the ranks left over by tensor and pipeline parallelism are data parallel",
    )
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        help="layers in each virtual stage: interleaved 1F1B over several chunks a rank",
    )
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        help="N virtual stages per pipeline rank (sets --num-layers-per-virtual-pipeline-stage)",
    )
    pipeline_model_parallel_layout: str | None = flag(
        "--pipeline-model-parallel-layout",
        help="Megatron's layout string, e.g. 'Et|(tt|)*3tmL': what each (virtual) stage holds, "
        "any number of layers (fmeg.config.pipeline_layout)",
    )
    decoder_first_pipeline_num_layers: int | None = flag(
        "--decoder-first-pipeline-num-layers",
        type=int,
        help="decoder layers of the first pipeline rank (the others split the rest evenly)",
    )
    decoder_last_pipeline_num_layers: int | None = flag(
        "--decoder-last-pipeline-num-layers",
        type=int,
        help="decoder layers of the last pipeline rank (the others split the rest evenly)",
    )
    account_for_embedding_in_pipeline_split: bool = switch(
        "--account-for-embedding-in-pipeline-split",
        help="count the embedding as a layer when splitting: the first stage holds one layer less",
    )
    account_for_loss_in_pipeline_split: bool = switch(
        "--account-for-loss-in-pipeline-split",
        help="count the loss as a layer when splitting: the last stage holds one layer less",
    )
    pipeline_schedule: str = flag(
        "--pipeline-schedule",
        default="1f1b",
        choices=list(SCHEDULES),
        help="1f1b, gpipe and zero_bubble (ZB-H1) without virtual stages (interleaved 1F1B is used "
        "with them); zero_bubble_v (ZB-V) and dualpipe_v (DualPipeV) place 2 virtual stages per "
        "rank in a V. The zero-bubble ones split the backward: the linears' weight gradients "
        "deferred to fill the bubble (eager stages; compiled ones compute them in the backward)",
    )
    sequence_parallel: bool = switch(
        "--sequence-parallel",
        help="split the norms' and dropouts' activations over the tensor-parallel ranks along the "
        "sequence",
    )
    use_distributed_optimizer: bool = switch(
        "--use-distributed-optimizer",
        help="ZeRO-1: each data-parallel rank keeps a slice of the fp32 master weights and moments",
    )
    distributed_timeout_minutes: float = flag(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="how long a collective may wait before the job fails",
    )
    device: str = flag(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda:LOCAL_RANK with NCCL when CUDA is available, else CPU with gloo",
    )

    def problems(self) -> list[str]:
        """The sizes that must be positive before any layout is checked."""
        out = not_positive(self, "tensor_model_parallel_size", "pipeline_model_parallel_size")
        out += not_positive(self, "distributed_timeout_minutes")
        if self.device == "cuda" and not torch.cuda.is_available():
            out.append(
                "--device cuda: torch.cuda.is_available() is False (no GPU, or a CPU-only torch); "
                "use --device cpu"
            )
        return out


@group("overlap, recomputation and compilation")
class OverlapFlags:
    """What the step overlaps, recomputes and compiles."""

    overlap_grad_reduce: bool = switch(
        "--overlap-grad-reduce",
        help="start each data-parallel gradient bucket's reduction during the backward pass",
    )
    ddp_bucket_size: int | None = flag(
        "--ddp-bucket-size",
        type=int,
        help="elements per data-parallel gradient bucket (default max(40M, 1M * dp))",
    )
    recompute_granularity: str | None = flag(
        "--recompute-granularity",
        choices=["full", "selective"],
        help="full: recompute whole layers in backward instead of keeping their activations; "
        "selective: recompute the attention cores",
    )
    recompute_method: str | None = flag(
        "--recompute-method",
        choices=["uniform", "block"],
        help="uniform: recompute each chunk of --recompute-num-layers layers from its input; "
        "block: recompute the first --recompute-num-layers layers of each pipeline stage",
    )
    recompute_num_layers: int | None = flag(
        "--recompute-num-layers",
        type=int,
        help="with --recompute-granularity full: layers per recomputed block (uniform) or "
        "recomputed layers per stage (block)",
    )
    recompute_activations: bool = switch(
        "--recompute-activations", help="--recompute-granularity selective"
    )
    recompute_modules: list[str] | None = flag(
        "--recompute-modules",
        nargs="*",
        choices=SELECTIVE_MODULES,
        help="with --recompute-granularity selective: the pieces of each layer run again in "
        "backward (default core_attn): core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, "
        "shared_experts",
    )
    moe_layer_recompute: bool = switch(
        "--moe-layer-recompute",
        help="Megatron's deprecated spelling of --recompute-granularity selective "
        "--recompute-modules moe",
    )
    compile: bool | None = flag(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="run each pipeline stage torch.compile'd as one graph (each layer, the embedding and "
        "the loss head apart under --overlap-grad-reduce with dp > 1 or full recomputation; "
        "default: on with CUDA, off on CPU, where compiling takes longer than short runs train; "
        "off under --deterministic-mode, whose exact sums run eagerly)",
    )

    def problems(self) -> list[str]:
        return not_positive(self, "ddp_bucket_size")


def compile_asked(a: argparse.Namespace) -> bool:
    """Whether the flags ask for compiled stages: --compile, or by default with CUDA."""
    return bool(
        a.compile or (a.compile is None and a.device != "cpu" and torch.cuda.is_available())
    )


def compiles(a: argparse.Namespace) -> bool:
    """Whether the run's stages are compiled: as asked, but never under --deterministic-mode (its
    exact sums, fmeg.parallel.exact_regions, read host values)."""
    return compile_asked(a) and not a.deterministic_mode
