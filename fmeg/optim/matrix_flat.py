"""What the flat forms of the matrix optimizers (Muon's, SOAP's) share: their matrix leaves are one
group ("muon", which fmeg.state.matrix_step steps whole at their home ranks), every other leaf is
the scalar optimizer's (its flat form's groups and kernel), and a matrix's update is applied with
decoupled weight decay: W <- W (1 - lr wd) - lr update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fmeg.optim.base import GradientTransformation, chain, partition, without_stage
from fmeg.optim.transforms import Mask, add_decayed_weights, scale_by_learning_rate


@dataclass(frozen=True)
class MatrixFlat:
    settings: Any
    matrices: Any
    scalar: Any
    decay_mask: Mask
    moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
    # whether the matrix step keeps a state per matrix at its home rank
    keeps_matrix_state: ClassVar[bool] = False
    # the flat buffers the matrix leaves use (the scalar leaves use the scalar optimizer's kinds)
    matrix_kinds: ClassVar[tuple[str, ...]] = ("mu",)

    def group(self, path: str, leaf: torch.Tensor) -> Any:
        if self.matrices.is_matrix(without_stage(path), leaf):
            return "muon"
        return self.scalar.group(path, leaf)

    def step_(self, views, steps, group, **hyper: Any) -> None:
        self.scalar.step_(views, steps, group, **hyper)

    def fresh_state(self, path: str, whole_shape: tuple[int, ...], device: Any) -> Any:
        return None

    def apply_(
        self,
        master: torch.Tensor,
        nu: torch.Tensor | None,
        update: torch.Tensor,
        scale: torch.Tensor | None,
        *,
        lr: float,
        weight_decay: float,
        decays: bool,
    ) -> None:
        """A piece of the master weights stepped by its piece of the direction."""
        if decays and weight_decay:
            master.mul_(1 - lr * weight_decay)
        master.add_(update, alpha=-lr)


def matrices_and_the_rest(
    name: str,
    direction: GradientTransformation,
    scalar: GradientTransformation,
    matrices: Any,
    decay_mask: Mask,
    flat: MatrixFlat,
) -> GradientTransformation:
    """A matrix optimizer: direction (then decoupled decay where decay_mask says, then -lr) on
    matrices.is_matrix's leaves, scalar on the others, their states under name and "scalar";
    flat: its form over the runner's buffers."""
    matrix = chain(direction, add_decayed_weights(decay_mask), scale_by_learning_rate())
    pytree = partition(
        {name: matrix, "scalar": scalar},
        lambda path, leaf: name if matrices.is_matrix(path, leaf) else "scalar",
    )
    return pytree._replace(flat=flat)
