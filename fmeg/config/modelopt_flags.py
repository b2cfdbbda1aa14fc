"""The flags of Megatron-LM's post-training (ModelOpt) scripts (examples/post_training/modelopt:
finetune.sh, quantize.sh, export.sh and their conf/*.sh), as megatron/post_training/arguments.py
defines them.

fmeg trains, saves and exports plain models: the flags that choose how Megatron builds or exports
its model (Transformer Engine or local layers, a legacy checkpoint) cannot change a number, and are
named at start as ignored; the flags that ask for something fmeg lacks (quantization, distillation,
speculative-decoding features, Llama 4's layers, a Hugging Face Hub dataset) stop the run before
work starts, one line each, with the fix. Their "off" values (Megatron's defaults) run.
"""

from __future__ import annotations

import argparse

from fmeg.config.declare import group

# {flag: (argparse keywords, why it cannot change a number)}
IGNORED = {
    "--export-te-mcore-model": (
        {"action": "store_true"},
        "fmeg has one transformer implementation, and its checkpoints load at any layout",
    ),
    "--export-force-local-attention": (
        {"action": "store_true"},
        "attention runs torch's scaled_dot_product_attention, which picks its own kernel",
    ),
    "--export-legacy-megatron": ({"action": "store_true"}, "fmeg has one model implementation"),
    "--modelopt-enabled": (
        {"action": "store_true"},
        "set by Megatron when it loads a ModelOpt checkpoint; fmeg loads the weights, which is "
        "all a checkpoint without quantizers holds",
    ),
    "--trust-remote-code": (
        {"action": "store_true"},
        "fmeg runs no code from a model or tokenizer directory: its tokenizers read "
        "tokenizer.json, and import reads config.json and safetensors",
    ),
    "--finetune-data-split": ({"default": None}, "has no effect without --finetune-hf-dataset"),
}
# {flag: (argparse keywords, the values that mean "off", what fmeg lacks, the fix)}
REFUSED = {
    "--export-model-type": (
        {"default": "GPTModel"},
        ("GPTModel",),
        "Mamba models are not supported by fmeg",
        "use GPTModel",
    ),
    "--export-quant-cfg": (
        {"default": None},
        (None, "None"),
        "quantization (ModelOpt's recipes) is not supported by fmeg",
        "drop the flag; fmeg trains and exports bf16/fp32 weights",
    ),
    "--export-real-quant-cfg": (
        {"default": "None"},
        ("None", None),
        "quantized weights are not supported by fmeg",
        "use None or drop the flag",
    ),
    "--export-kv-cache-quant": (
        {"default": "none"},
        ("none", None),
        "KV-cache quantization is not supported by fmeg",
        "use none or drop the flag",
    ),
    "--export-kd-teacher-load": (
        {"default": None},
        (None,),
        "knowledge distillation is not supported by fmeg yet",
        "drop the flag",
    ),
    "--export-kd-teacher-model-config": (
        {"default": None},
        (None,),
        "knowledge distillation is not supported by fmeg yet",
        "drop the flag",
    ),
    "--export-kd-teacher-ckpt-format": (
        {"default": None},
        (None,),
        "knowledge distillation is not supported by fmeg yet",
        "drop the flag",
    ),
    "--export-kd-cfg": (
        {"default": None},
        (None,),
        "knowledge distillation is not supported by fmeg yet",
        "drop the flag",
    ),
    "--export-offline-model": (
        {"action": "store_true"},
        (False,),
        "offline speculative-decoding training is not supported by fmeg",
        "drop the flag",
    ),
    "--offline-distillation-data": (
        {"default": None},
        (None,),
        "offline speculative-decoding training is not supported by fmeg",
        "drop the flag",
    ),
    "--export-qk-l2-norm": (
        {"action": "store_true"},
        (False,),
        "Llama 4's L2-normalised queries and keys are not supported by fmeg yet",
        "drop the flag",
    ),
    "--export-moe-apply-probs-on-input": (
        {"action": "store_true"},
        (False,),
        "Llama 4's expert scaling on the input is not supported by fmeg yet",
        "drop the flag",
    ),
    "--finetune-hf-dataset": (
        {"default": None},
        (None,),
        "fmeg reads no Hugging Face Hub dataset (no download inside a run)",
        'write its conversations as JSONL lines of {"messages": [...]} '
        "(datasets' to_json) and pass --sft --data-path FILE.jsonl",
    ),
}


@group("Megatron's post-training (ModelOpt) flags: ignored or refused, named at start")
class ModelOptFlags:
    """Megatron's ModelOpt flags, accepted to be named as ignored or refused."""

    ACCEPTED = {
        **{f: dict(**kw, help=argparse.SUPPRESS) for f, (kw, _) in IGNORED.items()},
        **{f: dict(**kw, help=argparse.SUPPRESS) for f, (kw, *_) in REFUSED.items()},
    }


def _value(a: argparse.Namespace, flag: str):
    return getattr(a, flag.lstrip("-").replace("-", "_"))


def ignored(a: argparse.Namespace) -> list[str]:
    """'--flag: why' for each ModelOpt flag given to no effect."""
    return [
        f"{flag}: {why}"
        for flag, (_, why) in IGNORED.items()
        if _value(a, flag) not in (None, False)
    ]


def problems(a: argparse.Namespace) -> list[str]:
    """One line for each ModelOpt flag that asks for what fmeg lacks."""
    out = []
    for flag, (_, off, lacking, fix) in REFUSED.items():
        value = _value(a, flag)
        if value not in off:
            out.append(f"{flag if value is True else f'{flag} {value}'}: {lacking}; {fix}")
    return out
