"""fmeg's GPT weights written as a Megatron-LM torch_dist checkpoint that megatron-core's
dist_checkpointing.load reads into its GPTModel, at whatever tp / pp / ep Megatron resumes it.

    # root/iter_NNNNNNN/{.metadata, __0_0.distcp, common.pt,
    write_torch_dist(root, params, config, args)
                                                   #
                                                       metadata.json} and
                                                       root/latest_checkpointed_iteration.txt

Each tensor is one chunk holding all of it, under megatron-core's key (gpt_keys): layers stacked in
a leading dimension, experts behind it, a gated fc1 as one [2F, H] matrix, the vocabulary padded as
`args` says Megatron pads it (the padding rows zeros). PyTorch's own distributed checkpoint writer
writes the chunks and .metadata; common.pt holds Megatron's args, the iteration and
checkpoint_version 3.0, as Megatron-LM's training loop saves them; there is no optimizer state or
RNG state (resume with --no-load-optim --no-load-rng, or --finetune). The norms have the names both
of megatron-core's layer specs save (Transformer Engine's fused `linear_qkv.layer_norm_weight`; its
local spec maps `input_layernorm` to it), a MoE layer's `pre_mlp_layernorm`. The directory is
written under a temporary name and renamed, so a failed export leaves no checkpoint behind.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from fmeg import tree
from fmeg.interop.megatron import gpt_keys
from fmeg.models import gpt

METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def megatron_tensors(
    params: dict, config: gpt.GPTConfig, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """One-device params as megatron-core's global tensors, by its key."""
    gated = config.activation == "swiglu"
    params = gpt.repad_vocab(params, config, padded_vocab)
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[int, torch.Tensor]] = {}
    flat = tree.flatten(params)
    # the last pipeline stage's copy of the embedding: Megatron saves the embedding only
    if config.tie_embeddings:
        flat.pop("output.weight", None)
    for path, t in flat.items():
        src = gpt_keys.source(path, gated)
        if src is None:
            raise ValueError(
                f"{path}: megatron-core's GPTModel has no such tensor; this model cannot be "
                "exported"
            )
        key = src.keys[0]
        t = t.reshape(gpt_keys.megatron_shape(src, tuple(t.shape))).contiguous()
        if src.layer is None:
            out[key] = t
            continue
        layers.setdefault(key, {})[src.layer] = t
        if ".mlp_norm." in path and f"{path.rsplit('.mlp_norm.', 1)[0]}.mlp.router.weight" in flat:
            # a MoE layer's norm: the local spec saves it as linear_fc1's, Transformer Engine's as
            # its own
            layers.setdefault(src.keys[-1], {})[src.layer] = t
    for key, by_layer in layers.items():
        if sorted(by_layer) != list(range(config.num_layers)):
            raise ValueError(
                f"{key}: only layers {sorted(by_layer)} of {config.num_layers} hold it (dense and "
                "MoE layers mixed by --moe-layer-freq); fmeg exports models whose layers are alike"
            )
        out[key] = torch.stack([by_layer[i] for i in range(config.num_layers)])
    return out


_LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
)


def extra_states(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """megatron-core's `_extra_state` objects of each linear layer (Transformer Engine's FP8
    metadata; None for the local spec's, and for a model trained without FP8): one per layer, and
    per expert, under the keys its sharded objects take
    ("{module}._extra_state/shard_{layer}_{layers}", experts "shard_{layer}.{e}_{L}.{E}"), each the
    list of one None that megatron-core serializes for it."""
    out = {}
    for key, t in tensors.items():
        module = key.removeprefix("decoder.layers.").removesuffix(".weight")
        if key.endswith(".weight") and module in _LINEARS:
            for layer in range(t.shape[0]):
                out[f"decoder.layers.{module}._extra_state/shard_{layer}_{t.shape[0]}"] = [None]
        elif key.endswith(".weight") and module in (
            "mlp.experts.experts.linear_fc1",
            "mlp.experts.experts.linear_fc2",
        ):
            for layer in range(t.shape[0]):
                for e in range(t.shape[1]):
                    shard = f"shard_{layer}.{e}_{t.shape[0]}.{t.shape[1]}"
                    out[f"decoder.layers.{module}._extra_state/{shard}"] = [None]
    return out


def _writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        # no checkpoint_id: it would name the temporary directory
        def storage_meta(self):
            return None

    return Writer


def layout_problem(config: gpt.GPTConfig, tp: int, pp: int, ep: int) -> str | None:
    """Why megatron-core could not build this model at tp / pp / ep (its divisibility rules), or
    None."""
    c = config
    rules = [
        (c.num_heads, tp, "--num-attention-heads", "--tensor-model-parallel-size"),
        (
            c.num_kv_heads,
            tp,
            "the query groups (--num-query-groups)",
            "--tensor-model-parallel-size",
        ),
        (c.ffn_hidden_size, tp, "--ffn-hidden-size", "--tensor-model-parallel-size"),
        (c.num_layers, pp, "--num-layers", "--pipeline-model-parallel-size"),
    ]
    if c.experts:
        rules += [
            (c.experts.num_experts, ep, "--num-experts", "--expert-model-parallel-size"),
            (
                c.experts.ffn_hidden_size or c.ffn_hidden_size,
                tp,
                "--moe-ffn-hidden-size",
                "--tensor-model-parallel-size (Megatron's default expert tp)",
            ),
        ]
    elif ep > 1:
        return f"--expert-model-parallel-size {ep}: the model has no experts"
    for size, parts, what, flag in rules:
        if size % parts:
            return (
                f"{flag} {parts} does not divide the model's {what} {size}; megatron-core could "
                "not load it"
            )
    return None


def write_torch_dist(
    root: str | Path, tensors: dict[str, torch.Tensor], args: Any, common: dict | None = None
) -> Path:
    """Write `tensors` (megatron_tensors) and `args` as Megatron's checkpoint of iteration
    args.iteration under root, common.pt holding `common` too (the optimizer's: fmeg.interop.
    megatron.optimizer_state); returns the iteration directory. Refuses a root that already holds
    a checkpoint."""
    import torch.distributed.checkpoint as dcp

    _Writer = _writer_class()

    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(
            f"--save {root} exists and is not an empty directory; choose a new directory "
            "(conversions never overwrite)"
        )
    tracker = root / "latest_checkpointed_iteration.txt"
    final = root / f"iter_{args.iteration:07d}"
    tmp = root / f".{final.name}.tmp"
    made = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        # "assuming the intent is to save in a single process": it is
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                {**tensors, **extra_states(tensors)},
                storage_writer=_Writer(str(tmp), single_file_per_rank=True),
                planner=dcp.DefaultSavePlanner(flatten_state_dict=False),
                no_dist=True,
            )
        torch.save(
            {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": args.iteration,
                "num_floating_point_operations_so_far": 0,
                **(common or {}),
            },
            tmp / "common.pt",
        )
        (tmp / "metadata.json").write_text(json.dumps(METADATA_JSON))
        tmp.rename(final)
        tracker.write_text(str(args.iteration))
    except (OSError, CheckpointException) as e:
        # DCP wraps each rank's OSError (a full disk) in a CheckpointException: either way nothing
        # stays
        if isinstance(e, CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))
            # (the rank's exception, its frames)
            e = e[0] if isinstance(e, tuple) else e
        shutil.rmtree(tmp, ignore_errors=True)
        tracker.unlink(missing_ok=True)
        if made:
            shutil.rmtree(root, ignore_errors=True)
        raise ValueError(
            f"--save {root}: cannot write it ({' '.join(str(e).split())[:200]}); nothing was "
            "written"
        ) from None
    return final
