"""Train a small GPT on one device and watch the loss fall.

    python -m recipes.train_single                                  # bytes of the stdlib, ~1 minute on CPU
    python -m recipes.train_single --data-path train.bin --vocab-size 50257 --num-layers 6 --hidden-size 384

Flags use Megatron's names. The step is the runner's (fmeg.training.parallel_step.train_iteration on one
rank: forward, backward, clipping and AdamW over flat persistent buffers), with each layer compiled by
torch.compile unless --no-compile is given or compilation fails (then it runs eagerly, with a warning).
The multi-process runner with every parallel layout is recipes.gpt_pretrain.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from functools import partial

import numpy as np

from fmeg import optim, tree
from fmeg.data.default_corpus import default_corpus
from fmeg.data.token_file import load_tokens, random_windows
from fmeg.data.tokenizers import ByteTokenizer
from fmeg.log_line import megatron_log_line
from fmeg.models import gpt
from fmeg.ops import fold_in
from fmeg.parallel.mesh import Mesh
from fmeg.training.parallel_step import Layout, init_state, shard_params, train_iteration


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.train_single", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--data-path", help="Megatron .bin/.idx prefix, .npy, or raw .bin of --token-dtype "
                                         "(default: the standard library's sources as bytes)")
    data.add_argument("--token-dtype", default="uint16", help="dtype of a raw .bin token file")
    data.add_argument("--vocab-size", type=int, help="default: 256 for bytes, else the file's max id + 1")
    model = p.add_argument_group("model")
    model.add_argument("--model", choices=["gpt2", "llama"], default="gpt2", help="architecture family")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    model.add_argument("--ffn-hidden-size", type=int)
    model.add_argument("--seq-length", type=int, default=128)
    model.add_argument("--hidden-dropout", type=float, default=0.0)
    model.add_argument("--attention-dropout", type=float, default=0.0)
    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=16)
    train.add_argument("--train-iters", type=int, default=200)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--min-lr", type=float, default=3e-4)
    train.add_argument("--lr-decay-style", default="cosine", choices=optim.schedules.DECAY_STYLES)
    train.add_argument("--lr-warmup-iters", type=int, default=10)
    train.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log-interval", type=int, default=10)
    train.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    return p.parse_args(argv)


def check_args(a: argparse.Namespace) -> None:
    """Every flag problem as one line, before any work."""
    positive = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "train_iters", "log_interval"]
    for name in positive:
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.hidden_size % a.num_attention_heads:
        raise ValueError(f"--hidden-size {a.hidden_size} must be divisible by --num-attention-heads "
                         f"{a.num_attention_heads}")
    if a.num_query_groups is not None and (a.num_query_groups <= 0 or a.num_attention_heads % a.num_query_groups):
        raise ValueError(f"--num-query-groups {a.num_query_groups} must divide --num-attention-heads "
                         f"{a.num_attention_heads}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(a, name) < 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(a, name)}")
    if a.lr <= 0 or a.clip_grad < 0 or a.weight_decay < 0:
        raise ValueError("--lr must be positive, --clip-grad and --weight-decay non-negative")


def build_config(a: argparse.Namespace, vocab_size: int) -> gpt.GPTConfig:
    preset = gpt.GPTConfig.llama if a.model == "llama" else gpt.GPTConfig.gpt2
    return preset(vocab_size=vocab_size, max_seq_len=a.seq_length, num_layers=a.num_layers,
                  hidden_size=a.hidden_size, num_heads=a.num_attention_heads,
                  num_kv_heads=a.num_query_groups or a.num_attention_heads, ffn_hidden_size=a.ffn_hidden_size,
                  hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout)


def load_data(a: argparse.Namespace):
    if a.data_path is None:  # the embedded default: bytes of the standard library, end-of-document 256
        return np.asarray(default_corpus().tokens), a.vocab_size or ByteTokenizer.vocab_size
    tokens = load_tokens(a.data_path, a.token_dtype)
    top = int(tokens.max()) + 1
    if a.vocab_size is not None and a.vocab_size < top:
        raise ValueError(f"--vocab-size {a.vocab_size} is smaller than the largest token id + 1 ({top}) in "
                         f"{a.data_path}")
    return tokens, a.vocab_size or top


def with_eager_fallback(step):
    """step(compile=...) compiled; if compilation fails (no C++ compiler, an unsupported op), warn and go
    eager for good. A failed attempt stops before the optimizer, so retrying the iteration is safe."""
    state = {"compile": "inductor"}

    def run(**kwargs):
        try:
            return step(compile=state["compile"], **kwargs)
        except Exception as e:  # noqa: BLE001 - any backend failure means: run eagerly instead
            if state["compile"] is None:
                raise
            warnings.warn(f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "running the step eagerly (pass --no-compile to skip compiling)")
            state["compile"] = None
            return step(compile=None, **kwargs)

    return run


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        check_args(a)
        tokens, vocab_size = load_data(a)
        config = build_config(a, vocab_size)
        schedule = optim.LRSchedule(max_lr=a.lr, min_lr=a.min_lr, warmup_steps=a.lr_warmup_iters,
                                    decay_steps=a.lr_decay_iters or a.train_iters, style=a.lr_decay_style)
        random_windows(tokens, 1, a.seq_length, a.seed, 0)  # fails now if the data is too short
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    mesh, layout = Mesh.single(), Layout()
    params = shard_params(gpt.init(config, a.seed), config, layout, mesh)
    state = init_state(params, config, layout, mesh, distributed=False,
                       adam=(a.adam_beta1, a.adam_beta2, a.adam_eps))
    step = partial(train_iteration, state, config=config, layout=layout, mesh=mesh, weight_decay=a.weight_decay,
                   clip_grad=a.clip_grad)
    step = partial(step, compile=None) if a.no_compile else with_eager_fallback(step)
    print(f"fmeg train_single: {tree.num_params(params) / 1e6:.2f}M parameters, {len(tokens):,} tokens, "
          f"vocab {vocab_size}, {'eager' if a.no_compile else 'compiled'} layers", flush=True)

    losses, start, last_log = [], time.perf_counter(), time.perf_counter()
    for iteration in range(1, a.train_iters + 1):
        batch = random_windows(tokens, a.micro_batch_size, a.seq_length, a.seed, iteration)
        if a.hidden_dropout or a.attention_dropout:
            batch["dropout_key"] = fold_in(a.seed, iteration)
        lr = schedule(iteration - 1)  # Megatron: the scheduler advances after the step
        metrics = step(microbatches=[batch], lr=lr)
        losses.append(float(metrics["loss"]))
        if iteration % a.log_interval == 0 or iteration == a.train_iters:
            now = time.perf_counter()
            done_since = a.log_interval if iteration % a.log_interval == 0 else iteration % a.log_interval
            print(megatron_log_line(iteration=iteration, train_iters=a.train_iters,
                                    consumed_samples=iteration * a.micro_batch_size,
                                    elapsed_ms=(now - last_log) * 1e3 / done_since, lr=lr,
                                    global_batch_size=a.micro_batch_size, lm_loss=losses[-1],
                                    grad_norm=float(metrics["grad_norm"])), flush=True)
            last_log = now
    first, last = losses[0], sum(losses[-10:]) / len(losses[-10:])
    print(f"done: {a.train_iters} iterations in {time.perf_counter() - start:.1f} s; "
          f"lm loss {first:.3f} -> {last:.3f} (mean of the last 10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
