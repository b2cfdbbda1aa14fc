"""Generate text from an fmeg checkpoint, at any tensor x pipeline layout.

    python -m recipes.generate --load checkpoints/gpt --prompt "def main(" --tokens 64
    torchrun --nproc-per-node 4 -m recipes.generate --load checkpoints/gpt \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --prompt "import os" \\
        --temperature 0.8 --top-k 40 --seed 7

The checkpoint may have been saved at any layout: each rank reads only its own blocks of the
weights, as --load does. The tokenizer is the one the run was trained with (from the checkpoint's
arguments) unless --tokenizer-type and its files are given. One prompt streams to the terminal as it
is generated; several are generated as one batch. --json prints one JSON object per prompt (text,
token ids, logprobs, finish reason). Prompt i samples with seed --seed + i (mod 2**63), so a sampled
run is reproducible across layouts and batches. Problems with the flags, the checkpoint or a prompt
are one line and exit 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fmeg import checkpoint
from fmeg.cli import OneLineParser, print_refusal
from fmeg.data.tokenizers import TOKENIZER_TYPES, padded_vocab_size, tokenizer_from_flags
from fmeg.inference import SamplingParams, generate
from fmeg.inference.generate import check_prompts, stream
from fmeg.interop import megatron
from fmeg.config.checkpoint_args import megatron_model
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.tensor import TensorParallel
from fmeg.models.saved_config import saved_model
from fmeg.training.checkpoint_state import read_params
from fmeg.parallel.layout import Layout
from fmeg.training.session import first_problem


def model_flags(p: argparse.ArgumentParser) -> None:
    """The flags that say which model to load and how to lay it out (shared with recipes.serve)."""
    p.add_argument(
        "--load",
        required=True,
        help="a checkpoint directory, fmeg's or Megatron-LM's torch_dist (its "
        "newest iteration is used)",
    )
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="how long a rank waits in a collective for the others before it ends (as in Megatron)",
    )
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (default: fp32)")
    p.add_argument("--fp16", action="store_true", help="compute in float16")
    p.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="default: the one the checkpoint was trained with",
    )
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer's vocabulary; TikTokenizer's ids",
    )
    p.add_argument("--tiktoken-pattern", choices=["v1", "v2"])
    p.add_argument("--tiktoken-num-special-tokens", type=int)
    p.add_argument("--tiktoken-special-tokens", nargs="+")


def sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely ids (0: all; 1: greedy)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=0.0,
        help="sample from the smallest set of this mass (0: all)",
    )
    p.add_argument("--seed", type=int, default=1234)


@dataclass
class LoadedModel:
    """This rank's part of a model laid out for generation, and what it needs to run."""

    params: dict
    config: gpt.GPTConfig
    tokenizer: Any
    tp: TensorParallel
    pp_group: Any
    rank: int
    device: torch.device

    def run(self, prompts: list[list[int]], **options: Any):
        return generate(
            self.params, prompts, self.config, tp=self.tp, pp_group=self.pp_group, **options
        )

    def stream(self, prompts: list[list[int]], **options: Any):
        return stream(
            self.params, prompts, self.config, tp=self.tp, pp_group=self.pp_group, **options
        )


def flag_problems(a: argparse.Namespace, world: int) -> list[str]:
    problems = []
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        problems.append(
            "--tensor-model-parallel-size and --pipeline-model-parallel-size must be positive, "
            f"got {tp} and {pp}"
        )
    elif tp * pp != world:
        problems.append(
            f"generation runs on tp x pp = {tp} x {pp} = {tp * pp} ranks, but the world size is "
            f"{world}; launch {tp * pp} processes"
        )
    if a.bf16 and a.fp16:
        problems.append("--bf16 and --fp16 exclude each other; give one")
    if not (math.isfinite(a.distributed_timeout_minutes) and a.distributed_timeout_minutes > 0):
        problems.append(
            "--distributed-timeout-minutes must be a positive number, got "
            f"{a.distributed_timeout_minutes}"
        )
    if not os.path.isdir(a.load):
        problems.append(
            f"--load {a.load}: "
            + (
                "a file; name the checkpoint directory"
                if os.path.exists(a.load)
                else "no such directory"
            )
        )
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(a, name, None)
        if value is not None and not math.isfinite(value):
            problems.append(f"--{name.replace('_', '-')} must be a finite number, got {value}")
        elif value is not None and value < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        elif name == "top_p" and value is not None and value > 1.0:
            problems.append(f"--top-p must be at most 1, got {value}")
    seed = getattr(a, "seed", None)
    if seed is not None and not 0 <= seed <= 2**63 - 1:
        problems.append(f"--seed must be an integer from 0 to 2**63 - 1, got {seed}")
    if a.device == "cuda" and not torch.cuda.is_available():
        problems.append(
            "--device cuda: torch.cuda.is_available() is False (no GPU, or a CPU-only torch); use "
            "--device cpu"
        )
    return problems


def refuse(problems: list[str]) -> int:
    """Print the problems, one line each, once per job (fmeg.cli.print_refusal); the exit code
    for bad input."""
    print_refusal(problems)
    return 2


# Megatron's args name them too
_TOKENIZER_ARGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def _tokenizer(a: argparse.Namespace, saved: dict, vocab_size: int | None) -> Any:
    pick = (
        (lambda name: getattr(a, name, None) or saved.get(name))
        if a.tokenizer_type is None
        else (lambda name: getattr(a, name, None))
    )
    vocab_file, merge_file = pick("vocab_file"), pick("merge_file")
    kind = (
        a.tokenizer_type
        or saved.get("tokenizer_type")
        or ("GPT2BPETokenizer" if vocab_file and merge_file else "ByteTokenizer")
    )
    tokenizer = tokenizer_from_flags(kind, pick)
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"the checkpoint's vocabulary has {vocab_size} ids but {kind} has "
            f"{tokenizer.vocab_size}; give the tokenizer it was trained with (--tokenizer-type and "
            "its files)"
        )
    return tokenizer


def load_model(a: argparse.Namespace) -> LoadedModel:
    """Join the process group (under torchrun), then read this rank's blocks of the checkpoint
    (nothing else). Raises ValueError (or CheckpointError) with a one-line reason, the same on every
    rank."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if cuda
        else torch.device("cpu")
    )
    path = checkpoint.latest(a.load)
    if path is None:
        raise checkpoint.CheckpointError(
            f"--load {a.load}: no {checkpoint.LATEST}; not a checkpoint directory"
        )
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    # Megatron-LM's: the model and the tokenizer from its args
    if megatron.is_megatron(path):
        margs = megatron.saved_args(path)
        tokenizer = _tokenizer(
            a,
            {k: v for k in _TOKENIZER_ARGS if (v := getattr(margs, k, None))},
            getattr(margs, "vocab_size", None),
        )
        saved_config = megatron_model(margs, tokenizer.vocab_size)
        config = saved_config.replace(
            padded_vocab_size=padded_vocab_size(saved_config.vocab_size, tp)
        )
        opened = megatron.MegatronCheckpoint.open(path, config)
        opened.check(config)
    else:
        opened = checkpoint.Checkpoint.open(path)
        # refuses what a newer fmeg wrote
        saved_model(opened.meta.get("model", {}), f"--load {a.load}: {path.name}")
        saved_config = gpt.GPTConfig(**opened.meta["model"])
        tokenizer = _tokenizer(a, opened.meta.get("arguments", {}), saved_config.vocab_size)
        config = saved_config.replace(
            padded_vocab_size=padded_vocab_size(saved_config.vocab_size, tp)
        )
    with opened as ckpt:
        gpt.check_tensor_parallel(config, tp)
        if config.num_layers % pp:
            raise ValueError(
                f"--pipeline-model-parallel-size {pp} must divide the model's {config.num_layers} "
                "layers"
            )
        if world > 1:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                timeout=datetime.timedelta(minutes=a.distributed_timeout_minutes),
                device_id=device if cuda else None,
            )
            mesh = Mesh.from_torch_distributed(tp=tp, pp=pp, device=device)
        else:
            mesh = Mesh.single()
        dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
        problem, local = "", None
        try:
            local = read_params(ckpt, config, Layout(tp=tp, pp=pp), mesh, device, dtype)[
                mesh.coord("pp")
            ]
        except checkpoint.CheckpointError as e:
            problem = str(e)
        problem = first_problem(problem, device)
        if problem:
            raise checkpoint.CheckpointError(problem)
    return LoadedModel(
        local, config, tokenizer, TensorParallel(mesh.group("tp")), mesh.group("pp"), rank, device
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


class TextStream:
    """Decoded text, a piece at a time, holding back a trailing partial character (bytes, BPE
    pieces)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.shown = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.shown = text[self.shown :], len(text)
        return piece


def stop_on_strings(tokenizer: Any, stops: list[str]):
    """generate's stop condition for stop strings: a row stops once its decoded text contains one
    (None: no strings, no condition)."""
    if not stops:
        return None
    return lambda row, ids: any(s in tokenizer.decode(ids) for s in stops)


def cut_at_stop(text: str, stops: list[str]) -> str:
    """text up to the first stop string (excluded)."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text


def main(argv: list[str] | None = None) -> int:
    # inference only, and the caller's grad mode stays as it was
    with torch.no_grad():
        return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python -m recipes.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_flags(p)
    sampling_flags(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--tokens", type=int, default=64, help="how many tokens to generate per prompt")
    p.add_argument(
        "--stop", action="append", default=[], help="stop a row when its text contains this string"
    )
    p.add_argument("--ignore-eod", action="store_true", help="go on past the end-of-document token")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    a = p.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    problems = flag_problems(a, world) + (
        [f"--tokens must be >= 0, got {a.tokens}"] if a.tokens < 0 else []
    )
    if problems:
        return refuse(problems)
    try:
        model = load_model(a)
        prompts = [encode(model.tokenizer, text) for text in a.prompt]
        check_prompts(prompts, model.config, a.tokens)
    except (ValueError, OSError) as e:
        return refuse([str(e)])
    tokenizer = model.tokenizer
    stop = stop_on_strings(tokenizer, a.stop)
    options = dict(
        max_new_tokens=a.tokens,
        sampling=SamplingParams(a.temperature, a.top_k, a.top_p),
        seed=[(a.seed + i) % 2**63 for i in range(len(prompts))],
        eod=None if a.ignore_eod else tokenizer.eod,
        stop=stop,
    )
    if len(prompts) == 1 and not a.json:
        text = TextStream(tokenizer)
        if rank == 0:
            print(a.prompt[0], end="", flush=True)
        shown, ids = "", []
        for step in model.stream(prompts, **options):
            if step.ids[0] is not None and step.ids[0] != tokenizer.eod:
                ids.append(step.ids[0])
                piece = text.add(step.ids[0])
                visible = cut_at_stop(shown + piece, a.stop)[len(shown) :]
                shown += visible
                if rank == 0:
                    print(visible, end="", flush=True)
        # a last partial character, as the tokenizer decodes it (the --json text has it too)
        if rank == 0:
            print(cut_at_stop(tokenizer.decode(ids), a.stop)[len(shown) :], flush=True)
    else:
        out = model.run(prompts, **options)
        if rank == 0:
            for i, prompt in enumerate(a.prompt):
                ids = [t for t in out.tokens[i] if t != tokenizer.eod or a.ignore_eod]
                completion = cut_at_stop(tokenizer.decode(ids), a.stop)
                if a.json:
                    print(
                        json.dumps(
                            {
                                "prompt": prompt,
                                "text": completion,
                                "tokens": out.tokens[i],
                                "logprobs": out.logprobs[i],
                                "finish_reason": out.finish_reasons[i],
                            }
                        )
                    )
                else:
                    print(f"--- {i}\n{prompt}{completion}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
