"""The optimizer the runner steps, built from its configuration, and how a matrix optimizer sees
a leaf whole under tensor parallelism.

    # a GradientTransformation with a flat form
    tx = build(choice, config, decoupled, moment_dtypes)
    # a leaf's tp block <-> the whole leaf
    gather = TensorParallelLeaves(layout, mesh)

Every optimizer takes Megatron's decay mask (no decay on biases and norms) and --decoupled-lr's
leaves (the word embedding and the output layer). Lion's, SOAP's and Muon's matrices are
GPTMatrices' (Megatron's 2-D parameters; for Muon q, k and v apart unless --muon-no-split-qkv);
the rest is stepped by Adam (Muon's: Adam or Lion), as Megatron's emerging optimizers do.
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg import optim
from fmeg.config.optimizer_flags import OptimizerConfig
from fmeg.models import gpt
from fmeg.models.matrices import GPTMatrices
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.sharding import partition_of
from fmeg.state.experts import is_expert


def build(
    choice: OptimizerConfig,
    config: gpt.GPTConfig,
    decoupled: Any,
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
) -> optim.GradientTransformation:
    """The transform `choice` names; decoupled(path, leaf): the leaves --decoupled-lr applies to."""
    b1, b2, eps = choice.adam
    adam = optim.adamw(b1, b2, eps, moment_dtypes=moment_dtypes, decoupled=decoupled)
    if choice.name == "adam":
        return adam
    if choice.name == "sgd":
        return optim.sgd(choice.sgd_momentum, decoupled=decoupled)
    # Lion and SOAP see each parameter whole: no q/k/v split
    matrices = GPTMatrices(config, split_qkv=False)
    if choice.name == "lion":
        return optim.lion_on_matrices(*choice.lion, scalar=adam, matrices=matrices)
    if choice.name == "soap":
        return optim.soap(choice.soap, scalar=adam, matrices=matrices)
    if choice.name in ("muon", "adaptive_muon"):
        lion = optim.lion(*choice.muon_scalar_lion, decoupled=decoupled)
        return optim.muon(
            choice.muon,
            scalar=lion if choice.muon_scalar == "lion" else adam,
            matrices=GPTMatrices(config, choice.muon_split_qkv),
        )
    raise ValueError(f"optimizer {choice.name!r}: expected adam, sgd, lion, muon, soap")


class TensorParallelLeaves:
    """fmeg.state.matrix_step.LeafGather for a GPT's leaves ("stage.path") on this rank: a leaf
    tensor parallelism splits is gathered over tp (over expert_tp for the experts laid out apart)
    along its partition's dimension, in rank order; blockwise, nothing is gathered (Megatron's
    --muon-tp-mode blockwise: each shard its own matrix)."""

    def __init__(self, layout: Layout, mesh: Mesh, blockwise: bool = False):
        self.layout, self.mesh, self.blockwise = layout, mesh, blockwise

    def _split(self, path: str) -> tuple[Any, int, int, int] | None:
        """(group, dim, index, size) of the split of the leaf at path, or None."""
        part = partition_of(path.partition(".")[2], gpt.TP_RULES)
        axis = self._axis(path)
        size = self.mesh.size(axis)
        if part is None or size == 1 or self.blockwise:
            return None
        return self.mesh.group(axis), part.dim, self.mesh.coord(axis), size

    def _axis(self, path: str) -> str:
        expert = self.layout.experts_apart and is_expert(path.partition(".")[2])
        return "expert_tp" if expert else "tp"

    def whole_shape(self, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        split = self._split(path)
        if split is None:
            return tuple(shape)
        out = list(shape)
        out[split[1]] *= split[3]
        return tuple(out)

    def replica_axes(self, path: str, sliced: bool) -> list[str]:
        """The mesh axes of the ranks that compute a leaf's matrices alike: its tensor-parallel
        peers at its home, and with the buffers whole every data-parallel rank too."""
        axis = self._axis(path)
        if sliced:
            return [axis]
        return [axis, "expert_dp"] if axis == "expert_tp" else [axis, "cp", "dp"]

    def whole(self, path: str, local: torch.Tensor) -> torch.Tensor:
        split = self._split(path)
        return local if split is None else split[0].all_gather(local, split[1])

    def part(self, path: str, whole: torch.Tensor) -> torch.Tensor:
        split = self._split(path)
        if split is None:
            return whole
        _, dim, index, size = split
        return whole.chunk(size, dim)[index]
