"""Megatron's FP8 flags (megatron/core/transformer/transformer_config.py's fp8 fields, as its
argument factory names them), their defaults, and the run's Fp8Plan."""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from fmeg.config.declare import flag, flag_name, group, switch
from fmeg.config.parallel_flags import compiles
from fmeg.fp8.linear import BLOCK
from fmeg.fp8.plan import Fp8Plan
from fmeg.fp8.recipe import E4M3, E5M2, RECIPES, Fp8Recipe


@group("FP8")
class Fp8Flags:
    """FP8 GEMMs in the transformer layers' linears."""

    fp8: str | None = flag(
        "--fp8-format",
        choices=["e4m3", "hybrid"],
        help="FP8 GEMMs: e4m3 for every operand, or hybrid (e5m2 output gradients)",
    )
    fp8_recipe: str = flag(
        "--fp8-recipe",
        default="delayed",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
        help="delayed (Megatron's default): one scale per tensor from an amax history; "
        "tensorwise: from the tensor's amax now; blockwise: DeepSeek-V3's 1x128 and 128x128 "
        "blocks; mxfp8: 1x32 blocks, e8m0 scales",
    )
    fp8_margin: int = flag(
        "--fp8-margin", type=int, default=0, help="delayed scaling's scale / 2^margin"
    )
    fp8_amax_history_len: int = flag(
        "--fp8-amax-history-len", type=int, default=1, help="delayed scaling's amax window"
    )
    fp8_amax_compute_algo: str = flag(
        "--fp8-amax-compute-algo",
        default="most_recent",
        choices=["most_recent", "max"],
        help="delayed scaling's amax from its window",
    )
    fp8_wgrad: bool = flag(
        "--no-fp8-wgrad",
        "--disable-fp8-wgrad",
        action="store_false",
        default=True,
        help="delayed scaling: the weight gradient's GEMM in the compute dtype",
    )
    fp8_param_gather: bool = switch(
        "--fp8-param-gather",
        help="the distributed optimizer all-gathers the FP8 linears' weights as FP8 bytes "
        "(Megatron-FSDP's gathers stay in the compute dtype, as the start line says)",
    )
    first_last_layers_bf16: bool = switch(
        "--first-last-layers-bf16", help="keep the first and last layers out of FP8"
    )
    num_layers_at_start_in_bf16: int = flag(
        "--num-layers-at-start-in-bf16", type=int, default=1, help="with --first-last-layers-bf16"
    )
    num_layers_at_end_in_bf16: int = flag(
        "--num-layers-at-end-in-bf16", type=int, default=1, help="with --first-last-layers-bf16"
    )

    def problems(self) -> list[str]:
        if self.fp8 is None:
            return self._without_fp8()
        if self.fp8_recipe == "delayed" and self.first_last_layers_bf16:
            return [
                "--first-last-layers-bf16 with --fp8-recipe delayed: Megatron's delayed scaling "
                "does not support first / last layers in BF16; use --fp8-recipe tensorwise"
            ]
        if self.fp8_amax_history_len < 1:
            return [f"--fp8-amax-history-len must be at least 1, got {self.fp8_amax_history_len}"]
        if self.fp8_recipe == "custom":
            return [
                "--fp8-recipe custom needs Transformer Engine's quantizer factory; choose one of "
                f"{', '.join(RECIPES)}"
            ]
        out = []
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if self.first_last_layers_bf16 and getattr(self, name) < 0:
                out.append(f"--{name.replace('_', '-')} must be at least 0")
            # without the switch the counts keep no layer out of FP8: a mistaken command
            elif not self.first_last_layers_bf16 and getattr(self, name) != 1:
                out.append(
                    f"--{name.replace('_', '-')} applies to --first-last-layers-bf16, which is "
                    "not given: add it or drop this flag"
                )
        if self.fp8_recipe == "delayed":
            out.extend(self._margin_problems())
        return out

    def _without_fp8(self) -> list[str]:
        """Each FP8 flag given without --fp8-format, whose run has no FP8 GEMM for it to change."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "fp8" or value == f.default:
                continue
            given = flag_name(self, f.name)
            if f.metadata["flag"].options.get("action") is None:
                given += f" {value}"
            out.append(
                f"{given} applies to --fp8-format, which is not given: add --fp8-format e4m3 or "
                "hybrid, or drop this flag"
            )
        return out

    def _margin_problems(self) -> list[str]:
        """Delayed scaling's scale is fp8_max / amax / 2^margin (Transformer Engine's; Megatron
        bounds no margin): one whose scale leaves fp32's normal range even at an amax of 1
        overflows to inf (a negative margin) or vanishes (a positive one), and the loss turns NaN
        at the first renewed scale."""
        formats = (E4M3, E5M2) if self.fp8 == "hybrid" else (E4M3,)
        fp32 = torch.finfo(torch.float32)
        low = max(math.ceil(math.log2(torch.finfo(d).max / fp32.max)) for d in formats)
        high = min(math.floor(math.log2(torch.finfo(d).max / fp32.tiny)) for d in formats)
        if low <= self.fp8_margin <= high:
            return []
        return [
            f"--fp8-margin {self.fp8_margin}: delayed scaling's scale fp8_max / amax / "
            f"2^margin leaves fp32's range at this margin (inf or 0 even for an amax of 1, and "
            f"NaN losses); give a margin in [{low}, {high}] (Megatron's default: 0)"
        ]


def plan(a: argparse.Namespace) -> Fp8Plan | None:
    """The run's FP8 plan (None without --fp8-format)."""
    if a.fp8 is None:
        return None
    keep = a.first_last_layers_bf16
    delayed = a.fp8_recipe == "delayed"
    recipe = Fp8Recipe(
        a.fp8,
        a.fp8_recipe,
        history_len=a.fp8_amax_history_len if delayed else 1,
        algo=a.fp8_amax_compute_algo if delayed else "most_recent",
        margin=a.fp8_margin if delayed else 0,
        wgrad=a.fp8_wgrad or not delayed,
    )
    return Fp8Plan(
        recipe,
        a.num_layers,
        a.num_layers_at_start_in_bf16 if keep else 0,
        a.num_layers_at_end_in_bf16 if keep else 0,
        param_gather=a.fp8_param_gather,
    )


# torch.compile keeps the amaxes a delayed-scaling backward records from this release on (2.11's
# compiled backward dropped them: its gradients' scales stayed 1)
DELAYED_COMPILE_TORCH = (2, 13)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def problems(a: argparse.Namespace, config) -> list[str]:
    """Where a layout would put a block across two ranks (the blocks one device uses would not be
    this run's): each tensor-parallel share of a split feature dimension, and each context-parallel
    chunk of the sequence, must be whole blocks; and delayed scaling compiled on a torch whose
    compiler drops its backward's amax records. config: the model (fmeg.models.gpt.GPTConfig)."""
    if a.fp8 is None:
        return []
    compiled = compiles(a)
    if a.fp8_recipe == "delayed" and compiled and _torch_release() < DELAYED_COMPILE_TORCH:
        return [
            f"--fp8-recipe delayed with compiled stages needs torch 2.13 or later (this is torch "
            f"{torch.__version__}, whose compiler drops the amaxes the backward records); give "
            "--no-compile or --fp8-recipe tensorwise"
        ]
    out = _bf16_layer_problems(a)
    if a.fp8_recipe not in BLOCK or config is None:
        return out
    block, tp, cp = BLOCK[a.fp8_recipe], a.tensor_model_parallel_size, a.context_parallel_size
    if tp > 1:
        d, n, g = config.head_dim, config.num_heads, config.num_kv_heads
        shares = {
            "the MLP's hidden size": config.ffn_hidden_size,
            "attention's heads x channels": n * d,
            "the fused qkv rows": (n + 2 * g) * d,
        }
        for what, size in shares.items():
            if (size // tp) % block and not out:
                out.append(
                    f"--fp8-recipe {a.fp8_recipe} at --tensor-model-parallel-size {tp}: each "
                    f"rank's share of {what} ({size // tp}) must be a multiple of the {block}-"
                    "element block, or a block would straddle two ranks; change the sizes or tp"
                )
    out.extend(_expert_blocks(a, config, block))
    chunk = a.seq_length // (2 * cp)
    if cp > 1 and chunk % block:
        out.append(
            f"--fp8-recipe {a.fp8_recipe} at --context-parallel-size {cp}: each chunk of the "
            f"sequence ({chunk} tokens) must be a multiple of the {block}-token block of the "
            "weight gradient; change --seq-length or cp"
        )
    return out


def _bf16_layer_problems(a: argparse.Namespace) -> list[str]:
    """--first-last-layers-bf16's counts: at most the layers of a pipeline stage each (Megatron's
    rule), and together fewer than the decoder's layers, or no layer would run FP8."""
    start, end = a.num_layers_at_start_in_bf16, a.num_layers_at_end_in_bf16
    if not a.first_last_layers_bf16 or min(start, end) < 0 or a.num_layers <= 0:
        return []
    if start + end >= a.num_layers:
        return [
            f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} keep "
            f"all --num-layers {a.num_layers} in BF16: no layer would run FP8; keep fewer in "
            "BF16, or drop --fp8-format"
        ]
    most = a.num_layers // max(a.pipeline_model_parallel_size, 1)
    return [
        f"--{name.replace('_', '-')} {getattr(a, name)}: at most the layers per pipeline stage "
        f"({most}), as Megatron allows"
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
        if getattr(a, name) > most
    ]


def _expert_blocks(a: argparse.Namespace, config, block: int) -> list[str]:
    """Block recipes' experts: each (expert, microbatch) group of rows must reach one rank (the
    weight gradient's blocks run along its rows), and an expert tensor-parallel share of the
    experts' hidden size must be whole blocks."""
    if getattr(config, "experts", None) is None:
        return []
    tp, cp, ep = a.tensor_model_parallel_size, a.context_parallel_size, a.expert_model_parallel_size
    etp = a.expert_tensor_parallel_size or tp
    recipe = f"--fp8-recipe {a.fp8_recipe} with experts"
    if cp > 1 or (a.sequence_parallel and tp > 1 and (etp * ep) % tp):
        return [
            f"{recipe}: at this layout one microbatch's rows for an expert reach two ranks, and "
            f"the weight gradient's {block}-row blocks would straddle them (context parallelism, "
            "or tokens split over tp that the experts do not exchange); give "
            "--fp8-recipe tensorwise or delayed"
        ]
    ffn = config.experts.ffn_hidden_size or config.ffn_hidden_size
    if etp > 1 and (ffn // etp) % block:
        return [
            f"{recipe} at an expert tensor-parallel size of {etp}: each rank's share of the "
            f"experts' hidden size ({ffn // etp}) must be a multiple of the {block}-element block; "
            "change --moe-ffn-hidden-size or --expert-tensor-parallel-size"
        ]
    return []
