"""Megatron-LM's legacy checkpoint format (--ckpt-format torch) read as the global tensors a
torch_dist checkpoint holds, so that MegatronCheckpoint reads it the same way.

    iter_0000100/mp_rank_00_000/model_optim_rng.pt    tp rank 00, pp rank 000
    iter_0000100/mp_rank_01_000/model_optim_rng.pt    (mp_rank_TT without pp)

Each file is a torch.save'd dict {"model": its state dict, "args", "iteration", ...}, read by
safe_pickle's unpickler (every class it names an inert stand-in; nothing is imported or run). A
rank's state dict names its layers from 0 within its pipeline stage and holds its tensor-parallel
slice of each split tensor: the global tensor stacks the stages' layers in order and concatenates
the slices along the dimension Megatron splits (rows of the column-parallel linears and the
vocabulary tables, columns of the row-parallel ones), a gated fc1's slices [gate_r; up_r] put back
as [gate; up]. Models with experts and virtual pipeline stages are refused in one line. A
distributed optimizer's parameter state, beside each rank's file in distrib_optim.pt (per gradient
buffer, its buckets' param, exp_avg and exp_avg_sq concatenated without their padding), is held as
one flat tensor per buffer, "optimizer.distributed.dp_group_idx_R.gbuf_idx_G.stream.<state>" (R = tp
rank + tp x pp rank), that bucket_state places the parameters in.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from fmeg.checkpoint.boxes import Box
from fmeg.interop.megatron.safe_pickle import MegatronCheckpointError, plain_state, read_common

FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"
RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# the dimension tensor parallelism splits, by the tail of Megatron's name
SPLIT = {
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc2.weight": 1,
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
}
GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def rank_files(path: Path) -> dict[tuple[int, int], Path]:
    """{(tp rank, pp rank): its file} of an iteration directory (empty: not this format)."""
    out = {}
    for d in sorted(Path(path).glob("mp_rank_*")):
        m = RANK.match(d.name)
        if m and (d / FILE).is_file():
            out[(int(m.group(1)), int(m.group(2) or 0))] = d / FILE
    return out


def is_legacy(path: Path) -> bool:
    return bool(rank_files(path))


def _tail(key: str) -> str:
    m = LAYER.match(key)
    return m.group(2) if m else key


def _joined(key: str, parts: list[torch.Tensor], gated: bool) -> torch.Tensor:
    dim = SPLIT.get(_tail(key))
    if dim is None or len(parts) == 1:
        return parts[0]
    if gated and _tail(key) in GATED:
        halves = [p.chunk(2, 0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim)


class LegacyTorchDir:
    """TorchDistDir's reading interface (has, shape, dtype, covers, read) over a legacy iteration
    directory, its global tensors assembled in memory once."""

    def __init__(self, path: Path, gated: bool):
        self.path, self.bytes_read = Path(path), 0
        files = rank_files(self.path)
        if not files:
            raise MegatronCheckpointError(f"{path}: no mp_rank_*/{FILE}")
        tp = max(t for t, _ in files) + 1
        pp = max(p for _, p in files) + 1
        missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in files]
        if missing:
            t, p = missing[0]
            raise MegatronCheckpointError(
                f"{path}: tensor-parallel rank {t} of pipeline rank {p} has no {FILE}; the "
                "checkpoint is incomplete"
            )
        states = {rank: read_common(f) for rank, f in files.items()}
        self.common = {k: v for k, v in states[(0, 0)].items() if k != "model"}
        for f, state in zip(files.values(), states.values()):
            if not isinstance(state.get("model"), dict):
                raise MegatronCheckpointError(
                    f"{f}: holds no single model state dict (virtual pipeline stages, model0 ...,"
                    " are not read: convert the checkpoint to torch_dist with Megatron)"
                )
        self.tensors = self._assemble(states, tp, pp, gated)
        # {(None: no chained optimizer, model-parallel rank, buffer): (its tensors' key prefix,
        # their elements)}
        self.streams: dict[tuple, tuple[str, int]] = {}
        for (t, p), f in files.items():
            if (f.parent / OPTIMIZER_FILE).is_file():
                self._add_streams(f.parent / OPTIMIZER_FILE, t + tp * p)

    def _add_streams(self, path: Path, domain: int) -> None:
        """A distrib_optim.pt's buffers as flat tensors (a chained optimizer's list: the
        first's)."""
        saved = plain_state(read_common(path), path)
        if not saved.get("buckets_coalesced"):
            raise MegatronCheckpointError(
                f"{path}: an older layout of the distributed optimizer's state (buckets not "
                "coalesced); resume it once in Megatron-LM and save to rewrite it"
            )
        for buffer, by_dtype in saved.items():
            if not isinstance(buffer, int) or not isinstance(by_dtype, dict) or len(by_dtype) != 1:
                continue
            state = next(iter(by_dtype.values()))
            prefix = f"optimizer.distributed.dp_group_idx_{domain}.gbuf_idx_{buffer}.stream"
            for name, values in state.items():
                if isinstance(values, torch.Tensor):
                    self.tensors[f"{prefix}.{name}"] = values
            self.streams[(None, domain, buffer)] = (prefix, int(state["param"].numel()))

    def _assemble(self, states: dict, tp: int, pp: int, gated: bool) -> dict[str, torch.Tensor]:
        by_key: dict[str, list[torch.Tensor]] = {}
        layers: dict[str, dict[int, torch.Tensor]] = {}
        offset = 0
        for p in range(pp):
            models = [states[(t, p)]["model"] for t in range(tp)]
            keys = [k for k, v in models[0].items() if isinstance(v, torch.Tensor)]
            if any(".mlp.experts." in k or ".mlp.router." in k for k in keys):
                raise MegatronCheckpointError(
                    f"{self.path}: a model with experts; fmeg reads those from torch_dist "
                    "checkpoints only: convert it with Megatron (--ckpt-convert-format torch_dist)"
                )
            count = 0
            for key in keys:
                whole = _joined(key, [m[key] for m in models], gated)
                m = LAYER.match(key)
                if m is None:
                    by_key.setdefault(key, [whole])
                    continue
                index = int(m.group(1))
                count = max(count, index + 1)
                layers.setdefault(f"decoder.layers.{m.group(2)}", {})[offset + index] = whole
            offset += count
        out = {key: parts[0] for key, parts in by_key.items()}
        for key, by_layer in layers.items():
            if sorted(by_layer) != list(range(offset)):
                raise MegatronCheckpointError(
                    f"{self.path}: {key} is held by layers {sorted(by_layer)} of {offset}; fmeg "
                    "reads models whose layers are alike"
                )
            out[key] = torch.stack([by_layer[i] for i in range(offset)])
        return out

    def has(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def covers(self, key: str, box: Box) -> bool:
        return key in self.tensors

    def read(self, wanted: list[tuple[str, Box, torch.Tensor]]) -> None:
        for key, box, out in wanted:
            values = self.tensors[key][tuple(slice(o, e) for o, e in zip(box.offset, box.end))]
            out.copy_(values.reshape(out.shape))
            self.bytes_read += values.numel() * values.element_size()
