"""A Megatron-LM torch_dist checkpoint opened as fmeg opens its own: the weights read by box at any
layout.

    # ck/iter_0000100 holding .metadata, *.distcp, common.pt
    if is_torch_dist(path):
        with MegatronCheckpoint.open(path, config) as ckpt:
            # Megatron's args against the flags' model: one line each
            ckpt.check(config)
            # fmeg.checkpoint.Request("params/<fmeg path>", box, out)
            ckpt.read(requests)

It answers the calls fmeg's resume makes of fmeg.checkpoint.Checkpoint (path, meta, has, dtype,
read, bytes_read): the model's weights are "params/<fmeg path>", found through gpt_keys; the
iteration and the consumed samples come from common.pt. The distributed optimizer's state saved
fully reshardable (--dist-ckpt-optim-fully-reshardable: each parameter's Adam moments and fp32
master as tensors of the parameter's global shape), or in flat buckets (Megatron's default
dp_reshardable; a legacy directory's distrib_optim.pt) placed by bucket_state, is "mu/", "nu/"
and "main/<fmeg path>", its step "adam/count" (the saved param groups); has() says whether the
checkpoint holds it. A vocabulary table's rows past
the vocabulary are padding, zeros as fmeg keeps them, whatever rows Megatron padded it to (it pads
for its tp) and whatever they held.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from fmeg import tree
from fmeg.checkpoint import CheckpointError, Request
from fmeg.checkpoint.boxes import Box
from fmeg.interop.megatron import bucket_state, gpt_keys, legacy, model_args
from fmeg.interop.megatron.safe_pickle import MegatronCheckpointError, plain_state, read_common
from fmeg.interop.megatron.torch_dist import TorchDistDir


# fmeg's kinds of state -> the prefix of their keys in Megatron's distributed optimizer state
OPTIMIZER_KEYS = {
    "params": "",
    "mu": "optimizer.state.exp_avg.",
    "nu": "optimizer.state.exp_avg_sq.",
    "main": "optimizer.state.param.",
}


# the layouts of the distributed optimizer's state whose parameters bucket_state places
BUCKETED = ("dp_reshardable", "distrib_optim.pt")
# the first model-parallel rank's distributed optimizer (its param groups) when dp_reshardable,
# alone or the first of a chained optimizer (dense and experts)
_OPTIMIZER_OBJECTS = [
    f"{chained}optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    for chained in ("", "chained_0.")
]


def _param_groups(saved: Any) -> list | None:
    """The param groups of a saved distributed optimizer's state: {"param_groups": ...}, or under
    "optimizer", or a chained optimizer's list or {index: state} of them (the first's)."""
    if isinstance(saved, dict) and isinstance(saved.get("param_groups"), list):
        return saved["param_groups"]
    if isinstance(saved, dict) and "optimizer" in saved:
        return _param_groups(saved["optimizer"])
    if isinstance(saved, dict) and saved and all(isinstance(k, int) for k in saved):
        saved = [saved[k] for k in sorted(saved)]
    for state in saved if isinstance(saved, list) else []:
        groups = _param_groups(state)
        if groups is not None:
            return groups
    return None


def is_torch_dist(path: Path) -> bool:
    """Whether an iteration directory is Megatron's torch_dist (its metadata.json names a sharded
    backend)."""
    try:
        meta = json.loads((Path(path) / "metadata.json").read_text())
    except (OSError, ValueError):
        return (Path(path) / ".metadata").is_file()
    return isinstance(meta, dict) and "sharded_backend" in meta


def is_megatron(path: Path) -> bool:
    """Whether an iteration directory is Megatron's: torch_dist, or the legacy mp_rank_* files."""
    return is_torch_dist(path) or legacy.is_legacy(path)


def _common(path: Path) -> dict:
    """common.pt's dict, or a legacy checkpoint's first rank file's (without its weights)."""
    if not is_torch_dist(path) and legacy.is_legacy(path):
        first = legacy.rank_files(path)[(0, 0)]
        return {k: v for k, v in read_common(first).items() if k != "model"}
    return read_common(Path(path) / "common.pt")


def saved_args(path: Path) -> Any:
    """The args Namespace of an iteration directory's common.pt (a legacy checkpoint's first rank
    file); a CheckpointError when it holds none."""
    try:
        args = _common(path).get("args")
    except MegatronCheckpointError as e:
        raise CheckpointError(str(e)) from None
    if args is None:
        raise CheckpointError(
            f"{Path(path) / 'common.pt'}: holds no Megatron args to build the model from; give the "
            "model's flags to recipes.gpt_pretrain with --load instead"
        )
    return args


class MegatronCheckpoint:
    def __init__(self, path: Path, dist: TorchDistDir, common: dict, config: Any):
        self.path, self.dist, self.common, self.config = path, dist, common, config
        # the files as opened: _decode_buckets wraps self.dist in the optimizer's buckets, and a
        # legacy directory must still be described (and its optimizer's sharding named) as one
        self.files = dist
        self.args = common.get("args")
        # why a dp_reshardable optimizer state could not be placed, once tried
        self.unplaced: str | None = None
        # what was read of the saved optimizer's objects
        self._saved: dict[str, Any] = {}
        self.shapes = {p: tuple(t.shape) for p, t in tree.items(_meta_init(config))}
        arg = lambda name, default=0: getattr(self.args, name, default) or default  # noqa: E731
        self.meta = {
            "iteration": int(common.get("iteration", 0) or 0),
            "consumed_samples": int(arg("consumed_train_samples")),
            "valid_consumed_samples": int(arg("consumed_valid_samples")),
            "layout": {
                "tp": arg("tensor_model_parallel_size", 1),
                "pp": arg("pipeline_model_parallel_size", 1),
                "ep": arg("expert_model_parallel_size", 1),
            },
        }

    @classmethod
    def open(cls, path: str | Path, config: Any) -> "MegatronCheckpoint":
        path = Path(path)
        try:
            if not is_torch_dist(path) and legacy.is_legacy(path):
                files = legacy.LegacyTorchDir(path, config.activation == "swiglu")
                return cls(path, files, files.common, config)
            return cls(path, TorchDistDir(path), read_common(path / "common.pt"), config)
        except MegatronCheckpointError as e:
            raise CheckpointError(str(e)) from None

    def describe(self) -> str:
        lay = self.meta["layout"]
        legacy_files = isinstance(self.files, legacy.LegacyTorchDir)
        kind = "--ckpt-format torch" if legacy_files else "torch_dist"
        return f"a Megatron {kind} checkpoint (tp {lay['tp']}, pp {lay['pp']}, ep {lay['ep']})"

    def check(self, config: Any) -> None:
        """Megatron's args (when common.pt holds them) against the flags' model: a CheckpointError
        naming the flags that differ, with both values. Shapes are checked again tensor by tensor as
        they are read."""
        if self.args is None:
            return
        damaged = model_args.damaged_dest(self.args)
        if damaged:
            raise CheckpointError(f"{self.path / 'common.pt'}: {damaged}; the file is damaged")
        diff = [
            f"{flag} {theirs} there, {ours} in the flags"
            for flag, theirs, ours in _compared(self.args, config)
            if theirs is not None and theirs != ours
        ]
        if diff:
            raise CheckpointError(
                f"{self.path / 'common.pt'}: the Megatron checkpoint's model differs from the "
                f"flags: {'; '.join(diff)}"
            )

    def _source(self, name: str) -> gpt_keys.Source | None:
        """The Megatron keys of an fmeg "kind/path" (the optimizer's under their prefix)."""
        kind, _, path = name.partition("/")
        src = gpt_keys.source(path, self.config.activation == "swiglu")
        if src is None or kind not in OPTIMIZER_KEYS:
            return None
        prefix = OPTIMIZER_KEYS[kind]
        # a chained optimizer's state saved without Megatron-LM's chained_optim_avoid_prefix
        # (older saves): its dense and experts' keys under chained_0. and chained_1.
        chained = ("",) if not prefix else ("", "chained_0.", "chained_1.")
        keys = tuple(c + prefix + k for k in src.keys for c in chained)
        return dataclasses.replace(src, keys=keys)

    def has(self, name: str) -> bool:
        if name == "adam/count":
            return self.optimizer_step() is not None
        src = self._source(name)
        if src is not None and not name.startswith("params/"):
            self._decode_buckets()
        return src is not None and any(self.dist.has(k) for k in src.keys)

    def dtype(self, name: str) -> torch.dtype:
        src = self._source(name)
        return next(self.dist.dtype(k) for k in src.keys if self.dist.has(k))

    def sharding(self) -> str | None:
        """How the distributed optimizer's state is laid out (fully_reshardable, dp_reshardable,
        ...), as the save recorded it, or None."""
        if getattr(self.files, "streams", None):
            # a legacy directory's distributed optimizer, gathered beside each rank's file
            return "distrib_optim.pt"
        content = self.common.get("content_metadata") or {}
        saved = content.get("distrib_optim_sharding_type") if isinstance(content, dict) else None
        optimizer = self.common.get("optimizer")
        if saved is None and isinstance(optimizer, dict):
            saved = optimizer.get("param_state_sharding_type")
        return saved if isinstance(saved, str) else None

    def optimizer_step(self) -> int | None:
        """The distributed optimizer's step (its param groups': in common.pt, or in the first
        model-parallel rank's saved object when dp_reshardable), or None."""
        try:
            where = f"{self.path / 'common.pt'} (its optimizer)"
            groups = _param_groups(plain_state(self.common.get("optimizer"), where))
            if groups is None and self.sharding() == "dp_reshardable":
                if "groups" not in self._saved:
                    saved = (self.dist.read_object(k) for k in _OPTIMIZER_OBJECTS)
                    self._saved["groups"] = _param_groups(next((x for x in saved if x), None))
                groups = self._saved["groups"]
        except MegatronCheckpointError as e:
            raise CheckpointError(str(e)) from None
        steps = [g.get("step") for g in groups or () if isinstance(g, dict)]
        steps = [int(s) for s in steps if s is not None]
        return max(steps) if steps else None

    def holds_optimizer_state(self) -> bool:
        """Whether the checkpoint holds the moments fmeg reads (saved fully or dp reshardable;
        optimizer_unread() says why not)."""
        return self.optimizer_step() is not None and self.has("mu/final_norm.weight")

    def optimizer_unread(self) -> str:
        """Why the checkpoint's optimizer state is not read, in a few words."""
        if self.unplaced is not None:
            return (
                f"the checkpoint's optimizer state ({self.sharding()}) is not placed: "
                f"{self.unplaced}"
            )
        if self.sharding() in (None, "fully_reshardable", *BUCKETED):
            return "the checkpoint holds no optimizer state fmeg reads"
        return (
            f"the checkpoint's optimizer state is saved {self.sharding()}, which fmeg does not read"
        )

    def _decode_buckets(self) -> None:
        """Answer the optimizer's keys from dp_reshardable buckets, once (unplaced says why
        not)."""
        if self.sharding() not in BUCKETED or self.unplaced is not None:
            return
        if isinstance(self.dist, bucket_state.BucketState):
            return
        try:
            self.dist = bucket_state.BucketState.decode(
                self.dist, self.args, self.config.activation == "swiglu"
            )
        except bucket_state.Unplaced as e:
            self.unplaced = str(e)
        except MegatronCheckpointError as e:
            raise CheckpointError(str(e)) from None

    @property
    def bytes_read(self) -> int:
        return self.dist.bytes_read

    def read(self, requests: list[Request]) -> None:
        wanted = []
        for r in requests:
            if r.name == "adam/count" and self.optimizer_step() is not None:
                r.out.fill_(self.optimizer_step())
                continue
            path = r.name.partition("/")[2]
            src = self._source(r.name)
            if src is None or path not in self.shapes:
                raise CheckpointError(
                    f"{self.path}: a Megatron checkpoint holds no {r.name} (fmeg reads its "
                    "weights, and Adam's state saved fully reshardable)"
                )
            for key, box, out in self._parts(path, src, r):
                wanted.append((key, box, out))
        try:
            self.dist.read(wanted)
        except MegatronCheckpointError as e:
            raise CheckpointError(str(e)) from None

    def _parts(self, path: str, src: gpt_keys.Source, r: Request) -> list:
        shape = self.shapes[path]
        box, out = r.box, r.out
        key = self._key(path, src)
        saved = self.dist.shape(key)
        want = gpt_keys.megatron_shape(src, shape)
        if src.layer is not None:
            # Megatron stacks every layer of the model
            want = (self.config.num_layers, *want)
        rows_differ = r.pad_with_zeros and len(saved) == len(want) and saved[1:] == want[1:]
        if saved != want and not rows_differ:
            raise CheckpointError(
                f"{self.path}: {key} has shape {list(saved)} there; this run's {path} needs "
                f"{list(want)} (the flags' model differs from the checkpoint's)"
            )
        if rows_differ and saved[0] < self.config.vocab_size:
            raise CheckpointError(
                f"{self.path}: {key} has {saved[0]} rows there, fewer than this run's vocabulary "
                f"of {self.config.vocab_size}; load it with the tokenizer it was trained with"
            )
        rows = min(saved[0], self.config.vocab_size) if r.pad_with_zeros else None
        # padding rows (Megatron's hold its init) are zeros, as fmeg's
        if rows is not None and box.end[0] > rows:
            keep = max(rows - box.offset[0], 0)
            out[keep:].zero_()
            box, out = Box(box.offset, (keep, *box.shape[1:])), out[:keep]
            if keep == 0:
                return []
        parts = []
        for mbox, index in gpt_keys.boxes(src, box, shape):
            view = out[index] if index else out
            parts.append((key, mbox, view.unsqueeze(0) if src.layer is not None else view))
        return parts

    def _key(self, path: str, src: gpt_keys.Source) -> str:
        for key in src.keys:
            if self.dist.has(key):
                shape = self.dist.shape(key)
                layer = (
                    Box((src.layer, *(0,) * (len(shape) - 1)), (1, *shape[1:]))
                    if src.layer is not None
                    else Box((0,) * len(shape), shape)
                )
                if src.layer is None or (shape[0] > src.layer and self.dist.covers(key, layer)):
                    return key
        raise CheckpointError(
            f"{self.path}: holds no {src.keys[0]}"
            + (f" for layer {src.layer}" if src.layer is not None else "")
            + f", which this run's {path} needs (the flags' model differs "
            "from the checkpoint's)"
        )

    def close(self) -> None:
        pass

    def __enter__(self) -> "MegatronCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _meta_init(config: Any) -> Any:
    from fmeg.models import gpt

    with torch.device("meta"):
        return gpt.init(config, 0, device="meta")


def _compared(args: Any, c: Any) -> list[tuple[str, Any, Any]]:
    """(Megatron's flag, the checkpoint's value, the flags' value) for what fixes the model's
    function."""
    from fmeg.models.moe import expert_ffn

    get = lambda name: getattr(args, name, None)  # noqa: E731
    groups = get("num_query_groups") if get("group_query_attention") else get("num_attention_heads")
    position = {"learned_absolute": "learned", "rope": "rope"}.get(
        get("position_embedding_type"), get("position_embedding_type")
    )
    norm = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}.get(
        get("normalization"), get("normalization")
    )
    untie = get("untie_embeddings_and_output_weights")
    return [
        ("--num-layers", get("num_layers"), c.num_layers),
        ("--hidden-size", get("hidden_size"), c.hidden_size),
        ("--num-attention-heads", get("num_attention_heads"), c.num_heads),
        ("--num-query-groups", groups, c.num_kv_heads),
        ("--ffn-hidden-size", get("ffn_hidden_size"), c.ffn_hidden_size),
        ("--kv-channels", get("kv_channels"), c.head_dim),
        ("--num-experts", get("num_experts"), c.experts.num_experts if c.experts else None),
        (
            "--moe-ffn-hidden-size",
            get("moe_ffn_hidden_size") if get("num_experts") else None,
            expert_ffn(c) if c.experts else None,
        ),
        ("--normalization", norm, c.norm),
        ("--position-embedding-type", position, c.position),
        ("--swiglu", get("swiglu"), c.activation == "swiglu"),
        (
            "--untie-embeddings-and-output-weights",
            None if untie is None else bool(untie),
            not c.tie_embeddings,
        ),
        ("--qk-layernorm", get("qk_layernorm"), c.attention.qk_norm),
    ]
