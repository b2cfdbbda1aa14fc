"""The training-state protocol: what the step, the checkpoints and the runner ask of a rank's state.

    state.params                          {stage: tree} of the weights, views of the buffers
    with state.use(stage, keys): ...      a segment's weights readable (gathered when sharded)
    sync = state.grad_sync(group, ...)
        backward accumulates into it: the data-parallel mean gradient
    norm = state.step(mesh, lr=..., weight_decay=..., clip_grad=...)   the optimizer, in place
    state.scaler                          the loss scaler (fp16), the step's to update
    state.parts
        the flat states that hold the buffers checkpoints read and write

FlatState (fmeg.state.flat) implements it over one set of flat buffers; ExpertSplitState
(fmeg.state.experts) over two, the dense leaves and the experts', each a FlatState. What only loops
over the parts is written once, in Parts, which ExpertSplitState inherits.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol, runtime_checkable

import torch

from fmeg import optim, tree


@runtime_checkable
class TrainingState(Protocol):
    """A rank's persistent training state: the weights in the compute dtype, the gradient buffers,
    the fp32 master weights and the optimizer's state, allocated once; every method updates them in
    place."""

    params: dict[int, Any]
    # the loss scaler's state (fmeg.optim.loss_scale; None: no scaling), which the step reads
    # and replaces
    scaler: Any

    @property
    def parts(self) -> tuple[Any, ...]: ...
    @property
    def opt_state(self) -> dict: ...
    def assign(self, values: dict[int, Any]) -> None: ...
    def grad_sync(
        self,
        group: Any,
        *,
        replicated: frozenset[str] = frozenset(),
        bucket_numel: int | None = None,
        overlap: bool = False,
        divisor: int | None = None,
        exact: bool = False,
    ) -> Any: ...
    def use(self, stage: int, keys: tuple[str, ...] | None, backward: bool = False) -> Any: ...
    def all_weights(self) -> Any: ...
    def end_iteration(self) -> None: ...
    def add_(self, path: str, delta: torch.Tensor) -> None: ...
    def main_grads(self) -> list[torch.Tensor]: ...
    def step(
        self,
        mesh: Any,
        *,
        lr: float,
        weight_decay: float,
        clip_grad: float,
        decoupled_lr: float | None = None,
        exact: bool = False,
    ) -> torch.Tensor: ...
    def set_count(self, count: int) -> None: ...
    def fresh_optimizer(self) -> None: ...
    def bytes_per_parameter(self) -> float: ...
    def persistent_bytes(self) -> int: ...


def step_parts(
    parts: tuple[Any, ...],
    groups: tuple[Any, ...],
    norm: torch.Tensor,
    *,
    clip_grad: float,
    lr: float,
    weight_decay: float,
    decoupled_lr: float | None,
    exact: bool = False,
) -> torch.Tensor:
    """The optimizer on every part, all clipped by the one global norm, then each part's compute
    weights refreshed over its data-parallel group (groups: one per part); returns norm. exact:
    the parts' updates independent of their slicing (FlatState.update)."""
    scale = optim.clip_scale(norm, clip_grad)
    for part, group in zip(parts, groups):
        part.update(scale, lr=lr, weight_decay=weight_decay, decoupled_lr=decoupled_lr, exact=exact)
        part.refresh(group)
    return norm


class Parts:
    """The protocol's methods that are the same call on each part, for a state of several
    FlatStates."""

    parts: tuple[Any, ...]

    @contextlib.contextmanager
    def use(
        self, stage: int, keys: tuple[str, ...] | None, backward: bool = False
    ) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.use(stage, keys, backward))
            yield

    @contextlib.contextmanager
    def all_weights(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.all_weights())
            yield

    def end_iteration(self) -> None:
        for part in self.parts:
            part.end_iteration()

    def main_grads(self) -> list[torch.Tensor]:
        return [grad for part in self.parts for grad in part.main_grads()]

    def set_count(self, count: int) -> None:
        for part in self.parts:
            part.set_count(count)

    def fresh_optimizer(self) -> None:
        for part in self.parts:
            part.fresh_optimizer()

    def persistent_bytes(self) -> int:
        return sum(part.persistent_bytes() for part in self.parts)

    def bytes_per_parameter(self) -> float:
        n = [tree.num_params(p.params) for p in self.parts]
        return sum(p.bytes_per_parameter() * k for p, k in zip(self.parts, n)) / max(sum(n), 1)
