"""The runner's configuration from its command line: the one place that reads the argparse
Namespace.

    cfg, tokenizer = load(argv, world_size)     # or BadInput: every problem, one line each

The flags (and a --config YAML file) are parsed with Megatron's rules, checked together
(validation), the tokenizer they name is built, and RunConfig holds the result; nothing reads the
Namespace after.
"""

from __future__ import annotations

from typing import Any

from fmeg.config.arguments import parse_args
from fmeg.config.run_config import RunConfig
from fmeg.config.validation import validate, wandb_missing
from fmeg.data.tokenizers import tokenizer_from_flags


class BadInput(Exception):
    """Problems with the flags, the tokenizer, the data or a checkpoint: one line each, exit 2."""

    def __init__(self, *lines: str):
        super().__init__(lines[0])
        self.lines = lines


def load(argv: list[str] | None, world: int) -> tuple[RunConfig, Any]:
    """(RunConfig, tokenizer) of validated flags, or BadInput naming every problem. Everything a
    user can get wrong in the flags is found here, before any process group exists."""
    a = parse_args(argv)
    problems = validate(a, world)
    missing = wandb_missing(a.wandb_project)
    if problems or missing:
        raise BadInput(*problems, *([missing] if missing else []))
    try:
        tokenizer = tokenizer_from_flags(a.tokenizer_type, lambda name: getattr(a, name, None))
    # a missing or unreadable tokenizer file
    except ValueError as e:
        raise BadInput(str(e)) from None
    if a.padded_vocab_size is not None and a.padded_vocab_size < tokenizer.vocab_size:
        raise BadInput(
            f"--padded-vocab-size {a.padded_vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); raise it or leave it out"
        )
    return RunConfig.from_args(a, world, tokenizer.vocab_size), tokenizer
