"""Convert fmeg checkpoints: consolidate shards, export to and import from Hugging Face and
Megatron-LM.

    python -m recipes.convert_checkpoint consolidate --load ckpt --output model.safetensors
    # config.json + model.safetensors
    python -m recipes.convert_checkpoint export-hf --load ckpt --output hf_model/
    # a starting checkpoint
    python -m recipes.convert_checkpoint import-hf --input hf_model/ --save ckpt
    # for Megatron at tp 1
    python -m recipes.convert_checkpoint export-megatron --load ckpt --save megatron_ckpt
    python -m recipes.convert_checkpoint import-megatron --input megatron_ckpt --save ckpt

export-megatron writes a torch_dist checkpoint (fmeg.interop.megatron.export) that Megatron-LM
resumes with its model flags, --load and --no-load-optim --no-load-rng (or --finetune), at the tp it
names (the vocabulary is padded for it). import-megatron builds the model from the checkpoint's args
and keeps its iteration and consumed samples; --load of a Megatron directory in recipes.gpt_pretrain
and recipes.generate needs no import.

consolidate writes every parameter as one full tensor under its path ("layers.0.attn.qkv.weight"),
with the model config as JSON in the file's metadata; the vocabulary is the real one (no padding
rows), as in export-hf, so neither output depends on the layout that saved. DeepSeek-V3's
multi-token prediction depths, which transformers' model does not hold, are read from and written to
the safetensors files in DeepSeek's layout. import-hf writes an iteration-0 checkpoint of one rank
(fresh optimizer state) that --load reshards into any layout; it reads config.json and safetensors
weights only (fmeg.interop.hf_dir: a directory of pickled weights, a damaged file, a config.json
that disagrees with the weights or a NaN weight is one line). No pickle is read or written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from fmeg import checkpoint, tree
from fmeg.cli import OneLineParser
from fmeg.interop import megatron
from fmeg.interop.hf_dir import ImportNotice
from fmeg.interop.megatron.model_args import args_for
from fmeg.config.checkpoint_args import megatron_model
from fmeg.models import gpt
from fmeg.models.saved_config import saved_model
from fmeg.parallel.mesh import Mesh
from fmeg.training.checkpoint_state import read_params, save_single_rank, saved_count
from fmeg.parallel.layout import Layout


def load_full(root: str) -> tuple[gpt.GPTConfig, dict]:
    """(config, single-rank params in fp32) of the newest checkpoint under root, fmeg's or
    Megatron's."""
    return load_checkpoint(root)[:2]


def load_checkpoint(root: str, vocab_size: int | None = None) -> tuple[gpt.GPTConfig, dict, dict]:
    """(config, single-rank params in fp32, meta) of the newest checkpoint under root, fmeg's or
    Megatron's (vocab_size: the tokenizer's, where Megatron's args record only the padded
    vocabulary)."""
    path = checkpoint.latest(root)
    if path is None:
        raise checkpoint.CheckpointError(
            f"{root}: no {checkpoint.LATEST}; not a checkpoint directory"
        )
    if megatron.is_megatron(path):
        config = megatron_model(megatron.saved_args(path), vocab_size)
        opened = megatron.MegatronCheckpoint.open(path, config)
        opened.check(config)
    else:
        opened = checkpoint.Checkpoint.open(path)
        # refuses what a newer fmeg wrote
        saved_model(opened.meta.get("model", {}), str(path))
        config = gpt.GPTConfig(**opened.meta["model"])
    with opened as ckpt:
        params = read_params(ckpt, config, Layout(), Mesh.single())[0]
        return config, params, ckpt.meta


def check_paths(args) -> None:
    """Refuse, before any work, to overwrite an output or to reach the network for an input."""
    if args.command in ("import-hf", "import-megatron"):
        if not Path(args.input).is_dir():
            raise ValueError(
                f"--input {args.input}: no such directory (import-hf reads a transformers model "
                "directory, config.json and weights, and never downloads)"
                if args.command == "import-hf"
                else f"--input {args.input}: no such directory"
            )
        if (Path(args.save) / checkpoint.LATEST).exists():
            raise ValueError(
                f"--save {args.save} already holds a checkpoint; choose a new directory"
            )
        return
    if args.command == "export-megatron":
        sizes = (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "make_vocab_size_divisible_by",
        )
        for name in sizes:
            if getattr(args, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
                )
        save = Path(args.save)
        if (save / "latest_checkpointed_iteration.txt").exists():
            raise ValueError(
                f"--save {args.save} already holds a Megatron checkpoint; choose a new directory"
            )
        refuse_filled("--save", save)
        return
    out = Path(args.output)
    if not out.parent.is_dir():
        raise ValueError(f"--output {out}: no directory {out.parent}; create it first")
    if args.command == "consolidate" and out.exists():
        raise ValueError(
            f"--output {out} exists; choose a new file name (conversions never overwrite)"
        )
    if args.command == "export-hf":
        refuse_filled("--output", out)


def refuse_filled(flag: str, directory: Path) -> None:
    """A ValueError unless directory is absent or empty: conversions never overwrite."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(
            f"{flag} {directory} exists and is not an empty directory; choose a new directory "
            "(conversions never overwrite)"
        )


def model_summary(config: gpt.GPTConfig, family: str) -> str:
    """One line of what was imported: "llama: 2 layers, hidden 64, 4 heads (2 kv), vocab 256"
    (with experts and MTP depths where it has them); the checkpoint holds the whole config."""

    def count(n: int, what: str) -> str:
        return f"{n} {what}" + ("" if n == 1 else "s")

    heads = count(config.num_heads, "head")
    if config.num_kv_heads != config.num_heads:
        heads += f" ({config.num_kv_heads} kv)"
    parts = [count(config.num_layers, "layer"), f"hidden {config.hidden_size}", heads]
    parts.append(f"vocab {config.vocab_size}")
    if config.experts is not None:
        parts.append(
            f"{count(config.experts.num_experts, 'expert')} (top {config.experts.router.topk})"
        )
    if config.mtp_depth:
        parts.append(count(config.mtp_depth, "MTP depth"))
    return f"{family}: " + ", ".join(parts)


def consolidate(args) -> None:
    config, params = load_full(args.load)
    params, config = (
        gpt.repad_vocab(params, config, config.vocab_size),
        config.replace(padded_vocab_size=None),
    )
    tensors = {k: v.contiguous() for k, v in tree.flatten(params).items()}
    out = Path(args.output)
    tmp = out.with_name(out.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"fmeg_config": json.dumps(config.flat())})
        tmp.replace(out)
    # a full disk, a read-only directory: nothing half-written stays
    except (OSError, SafetensorError) as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(
            f"--output {out}: cannot write it ({' '.join(str(e).split())[:200]}); nothing was "
            "written"
        ) from None
    print(f"wrote {out}: {len(tensors)} tensors, {tree.num_params(params):,} parameters")


def export_hf(args) -> None:
    from fmeg.interop.hf import mtp_files, to_hf
    from fmeg.interop.hf_dir import add_weight_file

    config, params = load_full(args.load)
    model, extra = to_hf(params, config), mtp_files(params, config)
    out = Path(args.output)
    tmp = out.with_name(out.name + ".tmp")
    # written beside, then renamed over the (absent or empty) output: nothing half-written stays
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        # DeepSeek-V3's MTP depths, which transformers' model does not hold
        if extra:
            add_weight_file(tmp, "model-mtp.safetensors", extra)
        tmp.replace(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(
            f"--output {out}: cannot write it ({' '.join(str(e).split())[:200]}); nothing was "
            "written"
        ) from None
    print(
        f"wrote {args.output} ({type(model).__name__}); load it with transformers' from_pretrained"
    )


def import_hf(args) -> None:
    from fmeg.interop.hf import read_dir
    from fmeg.training.parallel_step import init_state, shard_params

    config, params = read_dir(args.input)
    mesh, layout = Mesh.single(), Layout()
    state = init_state(shard_params(params, config, layout, mesh), config, layout, mesh)
    save_single_rank(args.save, 0, state, config, {"imported_from": str(args.input)})
    family = json.loads((Path(args.input) / "config.json").read_text())["model_type"]
    print(
        f"wrote {checkpoint.iteration_dir(args.save, 0)} from {args.input}: "
        f"{model_summary(config, family)}"
    )


def export_megatron(args) -> None:
    from fmeg.interop.megatron.export import layout_problem, megatron_tensors, write_torch_dist

    config, params, meta = load_checkpoint(args.load)
    problem = layout_problem(
        config,
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.expert_model_parallel_size,
    )
    if problem:
        raise ValueError(problem)
    megatron_args = args_for(
        config,
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        iteration=int(meta.get("iteration", 0)),
        consumed_train_samples=int(meta.get("consumed_samples", 0)),
        consumed_valid_samples=int(meta.get("valid_consumed_samples", 0)),
    )
    tensors = megatron_tensors(params, config, megatron_args.padded_vocab_size)
    moments, common = adam_state(args.load, config, meta, megatron_args.padded_vocab_size)
    where = write_torch_dist(args.save, {**tensors, **moments}, megatron_args, common)
    resume = (
        "--use-distributed-optimizer --no-load-rng"
        if moments
        else "--no-load-optim --no-load-rng (it holds no Adam state)"
    )
    print(
        f"wrote {where}: {len(tensors)} tensors, {tree.num_params(params):,} parameters"
        f"{', with Adam state' if moments else ''}; resume it in Megatron-LM with --load "
        f"{args.save} {resume} and the model's flags"
    )


def adam_state(root: str, config, meta: dict, padded_vocab: int) -> tuple[dict, dict]:
    """(Megatron's optimizer tensors, common.pt's optimizer part) of an fmeg checkpoint's Adam
    state, or ({}, {}) when it holds none (another optimizer's, --no-save-optim, Megatron's, or
    one that has taken no step: an import's)."""
    from fmeg.interop.megatron import optimizer_state

    if meta.get("optimizer_saved") is False or meta.get("optimizer", "adam") != "adam":
        return {}, {}
    path = checkpoint.latest(root)
    if megatron.is_megatron(path):
        return {}, {}
    with checkpoint.Checkpoint.open(path) as ckpt:
        if saved_count(ckpt) == 0:
            return {}, {}
        main = any(name.startswith("main/") for name in ckpt.entries)
        kinds = {"mu": "mu", "nu": "nu", "main": "main" if main else "params"}
        trees = {
            kind: read_params(ckpt, config, Layout(), Mesh.single(), kind=source)[0]
            for kind, source in kinds.items()
        }
        step = saved_count(ckpt)
    tensors = optimizer_state.state_tensors(trees, config, padded_vocab)
    common = optimizer_state.common_state(
        step, dict(meta.get("arguments", {})), int(meta.get("consumed_samples", 0))
    )
    return tensors, common


def import_megatron(args) -> None:
    from fmeg.training.parallel_step import init_state, shard_params

    config, params, meta = load_checkpoint(args.input, args.vocab_size)
    mesh, layout = Mesh.single(), Layout()
    state = init_state(shard_params(params, config, layout, mesh), config, layout, mesh)
    path = save_single_rank(
        args.save,
        meta["iteration"],
        state,
        config,
        {
            "consumed_samples": meta["consumed_samples"],
            "valid_consumed_samples": meta["valid_consumed_samples"],
            "imported_from": str(args.input),
        },
    )
    print(
        f"wrote {path} from {args.input} (the weights; the optimizer starts fresh): "
        f"{model_summary(config, 'Megatron GPT')}"
    )


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python -m recipes.convert_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate")
    c.add_argument("--load", required=True)
    c.add_argument("--output", required=True)
    e = sub.add_parser("export-hf")
    e.add_argument("--load", required=True)
    e.add_argument("--output", required=True)
    i = sub.add_parser("import-hf")
    i.add_argument("--input", required=True)
    i.add_argument("--save", required=True)
    m = sub.add_parser("export-megatron")
    m.add_argument("--load", required=True)
    m.add_argument(
        "--save", required=True, help="a new directory: Megatron's --load and --save root"
    )
    m.add_argument(
        "--tensor-model-parallel-size", type=int, default=1, help="the tp Megatron resumes at"
    )
    m.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    m.add_argument("--expert-model-parallel-size", type=int, default=1)
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    mi = sub.add_parser("import-megatron")
    mi.add_argument(
        "--input",
        required=True,
        help="Megatron's checkpoint root (its --save, holding latest_checkpointed_iteration.txt)",
    )
    mi.add_argument("--save", required=True)
    mi.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the tokenizer's ids, when the checkpoint's args record only the padded vocabulary",
    )
    args = p.parse_args(argv)
    try:
        check_paths(args)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", ImportNotice)
            {
                "consolidate": consolidate,
                "export-hf": export_hf,
                "import-hf": import_hf,
                "export-megatron": export_megatron,
                "import-megatron": import_megatron,
            }[args.command](args)
        for w in said:
            if issubclass(w.category, ImportNotice):
                print(f"warning: {w.message}", file=sys.stderr)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    except (checkpoint.CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
