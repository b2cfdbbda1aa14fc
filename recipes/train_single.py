"""Train a small GPT on one process from a token file and watch the loss fall: the runner's one-rank
case.

    # bytes of the stdlib, ~1 minute on CPU
    python -m recipes.train_single
    python -m recipes.train_single --data-path train.bin --vocab-size 50257 --num-layers 6 \\
        --hidden-size 384
    python -m recipes.train_single --data-path tokens.npy --model llama --num-query-groups 2

Every flag of recipes.gpt_pretrain works (the same RunConfig, Trainer and step), with defaults for a
quick look (2 layers, micro batch 16, 200 iterations, cosine decay from 3e-3 to 3e-4 after 10 warmup
iterations, no dropout). What this adds: --data-path takes a flat token file (.npy, a raw .bin of
--token-dtype, or a Megatron prefix read as one stream) sampled in random windows, --vocab-size is
the file's vocabulary (default: its largest id + 1), --model llama picks Llama's architecture flags,
and --num-query-groups alone means grouped-query attention.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from fmeg.data.default_corpus import default_corpus
from fmeg.data.token_file import TokenWindows, load_tokens
from fmeg.data.tokenizers import ByteTokenizer
from fmeg.config.arguments import parse_args
from fmeg.config.validation import validate
from fmeg.config.run_config import RunConfig
from fmeg.training.run_state import Checkpointer, build_or_restore
from fmeg.training.session import Session
from fmeg.training.trainer import Trainer
from recipes.gpt_pretrain import PROCESS_START, announce

DEFAULTS = [
    "--num-layers",
    "2",
    "--micro-batch-size",
    "16",
    "--train-iters",
    "200",
    "--lr-decay-style",
    "cosine",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "10",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
LLAMA = [
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]


def split_argv(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(this recipe's own flags, the runner's flags with its defaults and the --model preset)."""
    p = argparse.ArgumentParser(
        prog="python -m recipes.train_single", add_help=False, allow_abbrev=False
    )
    p.add_argument(
        "--data-path",
        help="a .npy, a raw .bin of --token-dtype, or a Megatron prefix "
        "(default: the standard library's sources as bytes)",
    )
    p.add_argument("--token-dtype", default="uint16", help="dtype of a raw .bin token file")
    p.add_argument(
        "--vocab-size", type=int, help="default: 257 for the bytes, else the file's largest id + 1"
    )
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    own, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if "-h" in rest or "--help" in rest:
        p.print_help()
    gqa = (
        ["--group-query-attention"]
        if any(r.split("=")[0] == "--num-query-groups" for r in rest)
        else []
    )
    return own, DEFAULTS + (LLAMA if own.model == "llama" else []) + gqa + rest


def load_data(own: argparse.Namespace) -> tuple[np.ndarray, int]:
    # the embedded default: bytes of the standard library, end-of-document 256
    if own.data_path is None:
        return np.asarray(default_corpus().tokens), own.vocab_size or ByteTokenizer.vocab_size
    tokens = load_tokens(own.data_path, own.token_dtype)
    top = int(tokens.max()) + 1
    if own.vocab_size is not None and own.vocab_size < top:
        raise ValueError(
            f"--vocab-size {own.vocab_size} is smaller than the largest token id + 1 ({top}) in "
            f"{own.data_path}"
        )
    return tokens, own.vocab_size or top


def main(argv: list[str] | None = None) -> int:
    own, runner_argv = split_argv(argv)
    a = parse_args(runner_argv, world_size=1)
    try:
        problems = validate(a, 1)
        if problems:
            raise ValueError(problems[0])
        tokens, vocab_size = load_data(own)
        cfg = RunConfig.from_args(a, 1, vocab_size)
        train = TokenWindows(tokens, cfg.data.seq_length, cfg.training.seed)
        valid = TokenWindows(tokens, cfg.data.seq_length, cfg.training.seed + 1)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    session = Session.start(cfg)
    torch.manual_seed(cfg.training.seed)
    state, progress, said = build_or_restore(cfg, session)
    for line in said:
        print(line, flush=True)
    print(
        f"fmeg train_single: {len(tokens):,} tokens, vocab {vocab_size}, model {own.model}",
        flush=True,
    )
    announce(cfg, session, state, [state.persistent_bytes()])
    saver = Checkpointer(cfg, session) if cfg.checkpoint.save else None
    return Trainer(cfg, session, state, progress, train, valid, saver, PROCESS_START).run()


if __name__ == "__main__":
    sys.exit(main())
