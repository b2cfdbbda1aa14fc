"""The training state under expert parallelism: the dense leaves and the experts' leaves in two
FlatStates.

    # {stage: tree} as FlatState takes it
    state = ExpertSplitState(params, counted, mesh, ep=2, ...)
    state.params                   # one {stage: tree}, views into both
    # gradients summed over dp x cp (dense) or expert_dp (experts), / dp
    sync = state.grad_sync(...)
    norm = state.step(mesh, ...)   # one global norm and clip over both, then AdamW on each

Expert-parallel ranks are data-parallel ranks holding different experts, so the experts' gradients
cannot join the dense leaves' data-parallel reduction: they are summed over the ranks holding the
same experts (megatron-core's expert_dp group, tp x dp / (ep x expert tp) ranks) and divided by dp,
which is the dense leaves' data-parallel mean over the same tokens. The global norm counts each
expert once: its squares are summed over the tp x ep x pp group instead of tp x pp.
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg import tree
from fmeg.state.flat import FlatState
from fmeg.state.protocol import Parts, step_parts


def is_expert(path: str) -> bool:
    return ".mlp.experts." in f".{path}"


def split_experts(values: dict[int, Any]) -> tuple[dict[int, Any], dict[int, Any]]:
    """({stage: the tree without the experts' leaves}, {stage: the experts' leaves only}), both
    nested as the model nests them (layers lists keep their length; a layer without experts is an
    empty dict)."""
    dense, experts = {}, {}
    for stage, t in values.items():
        dense[stage] = _select(t, keep_experts=False)
        experts[stage] = _select(t, keep_experts=True)
    return dense, experts


def _select(t: Any, keep_experts: bool, inside: bool = False) -> Any:
    if isinstance(t, dict):
        out = {}
        for k, v in t.items():
            now = inside or k == "experts"
            if isinstance(v, (dict, list)):
                out[k] = _select(v, keep_experts, now)
            elif now == keep_experts:
                out[k] = v
        if keep_experts:
            out = {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
        return out
    return [_select(v, keep_experts, inside) for v in t]


def merge(dense: Any, experts: Any) -> Any:
    """The inverse of split_experts for one tree."""
    if isinstance(dense, dict):
        out = dict(dense)
        for k, v in experts.items():
            out[k] = merge(dense[k], v) if k in dense else v
        return out
    if isinstance(dense, list):
        return [merge(d, e) for d, e in zip(dense, experts)]
    return dense


class _SplitSync:
    """The two data-parallel reductions of one backward: gradients go to the dense or the experts'
    sync by path; both divide their sum by the data-parallel size (for the experts, summed over
    expert_dp, that is their data-parallel mean)."""

    def __init__(self, dense, experts):
        self.dense, self.experts = dense, experts

    def add(self, stage: int, grads: dict[str, torch.Tensor], final: bool = False) -> None:
        mine = {p: g for p, g in grads.items() if is_expert(p)}
        if mine:
            self.experts.add(stage, mine, final)
        if len(mine) < len(grads):
            self.dense.add(stage, {p: g for p, g in grads.items() if not is_expert(p)}, final)

    def ready(self, stage: int, grads: dict[str, torch.Tensor]) -> None:
        self.add(stage, grads, final=True)

    def finish(self) -> "_SplitSync":
        self.dense.finish()
        self.experts.finish()
        return self

    def settle(self) -> "_SplitSync":
        self.dense.settle()
        return self

    def leaf(self, path: str) -> torch.Tensor:
        return self.dense.leaf(path)


class ExpertSplitState(Parts):
    """The training-state protocol (fmeg.state.protocol) over two FlatStates; what is the same call
    on each part comes from Parts."""

    def __init__(
        self,
        params: dict[int, Any],
        counted,
        mesh: Any,
        *,
        sharding: str,
        dp: int,
        **flat_state_options: Any,
    ):
        """params: this rank's fp32 {stage: tree} (its experts only); counted and the options as
        FlatState's. Sharded (FlatState's sharding) the dense state is sliced over dp x cp (the
        ranks holding the same dense weights), the experts' over expert_dp; dp: the data-parallel
        size, which both parts' summed gradients are divided by. Under hybrid sharding each part
        is sliced within its instance (dp_cp_shard, expert_dp_shard) and summed over the instances
        (dp_cp_outer, expert_dp_outer), as megatron-core splits its expert data-parallel group."""
        dense, experts = split_experts(params)
        if "expert_dp_shard" not in mesh.groups:
            raise ValueError(
                f"hybrid sharding's instances ({mesh.size('dp_cp_outer')}) must divide the "
                f"experts' data-parallel size ({mesh.size('expert_dp')})"
            )
        self.mesh, self.dp, self.zero = mesh, dp, sharding != "no_shard"
        # hybrid sharding: each part sliced within its instance, replicated over the instances
        self.dense = FlatState(
            dense,
            counted,
            sharding=sharding,
            dp=mesh.size("dp_cp_shard"),
            dp_rank=mesh.coord("dp_cp_shard"),
            dp_group=mesh.group("dp_cp_shard"),
            replica_group=mesh.group("dp_cp_outer"),
            **flat_state_options,
        )
        # a pipeline stage may hold no MoE layer: then no experts' state (its norm part is zero)
        self.experts = (
            FlatState(
                experts,
                counted,
                sharding=sharding,
                dp=mesh.size("expert_dp_shard"),
                dp_rank=mesh.coord("expert_dp_shard"),
                dp_group=mesh.group("expert_dp_shard"),
                replica_group=mesh.group("expert_dp_outer"),
                **flat_state_options,
            )
            if tree.tree_leaves(experts)
            else None
        )
        self.params = (
            {s: merge(self.dense.params[s], self.experts.params[s]) for s in params}
            if self.experts
            else self.dense.params
        )

    @property
    def scaler(self) -> Any:
        """The loss scaler of both parts' one step (held by the dense part)."""
        return self.dense.scaler

    @scaler.setter
    def scaler(self, value: Any) -> None:
        self.dense.scaler = value

    @property
    def parts(self) -> tuple[FlatState, ...]:
        return (self.dense, self.experts) if self.experts else (self.dense,)

    def assign(self, values: dict[int, Any]) -> None:
        """FlatState.assign on both parts."""
        dense, experts = split_experts(values)
        self.dense.assign(dense)
        if self.experts:
            self.experts.assign(experts)

    @property
    def opt_state(self) -> dict:
        if not self.experts:
            return self.dense.opt_state
        d, e = self.dense.opt_state, self.experts.opt_state
        name = next(k for k in d if k != "main")
        nu = None if d[name].nu is None else self._merged(d[name].nu, e[name].nu)
        state = {name: type(d[name])(d[name].count, self._merged(d[name].mu, e[name].mu), nu)}
        if "main" in d:
            state["main"] = self._merged(d["main"], e["main"])
        return state

    def _merged(self, dense: dict, experts: dict) -> dict:
        # flat slices (or the compact nu of the matrix optimizers): the experts' under a name of
        # their own
        if "compact" in dense:
            return {"compact": dense["compact"], "expert_compact": experts["compact"]}
        if self.zero:
            return {"shard": dense["shard"], "expert_shard": experts["shard"]}
        return {s: merge(dense[s], experts[s]) for s in dense}

    def grad_sync(
        self,
        group: Any,
        *,
        replicated: frozenset[str] = frozenset(),
        bucket_numel: int | None = None,
        overlap: bool = False,
        divisor: int | None = None,
        exact: bool = False,
    ) -> _SplitSync:
        """group: the dense leaves' data-parallel group (within the instance); the experts reduce
        over the mesh's expert_dp_shard group (expert_dp without hybrid sharding), then over the
        instances; both sums are divided by divisor (default: the data-parallel size), the
        mean over dp of each leaf's tokens."""
        divisor = self.dp if divisor is None else divisor
        dense = self.dense.grad_sync(
            group,
            replicated=replicated,
            bucket_numel=bucket_numel,
            overlap=overlap,
            divisor=divisor,
            exact=exact,
        )
        if not self.experts:
            return dense
        experts = self.experts.grad_sync(
            self.mesh.group("expert_dp_shard"),
            bucket_numel=bucket_numel,
            overlap=overlap,
            divisor=divisor,
            exact=exact,
        )
        return _SplitSync(dense, experts)

    def add_(self, path: str, delta: torch.Tensor) -> None:
        (self.experts if is_expert(path) else self.dense).add_(path, delta)

    @torch.no_grad()
    def step(
        self,
        mesh: Any,
        *,
        lr: float,
        weight_decay: float,
        clip_grad: float,
        decoupled_lr: float | None = None,
        exact: bool = False,
    ) -> torch.Tensor:
        # exact: each part's sum of squares is exact, their sum rounds once more (with experts
        # apart, not yet one rank's bits)
        experts = (
            self.experts.norm_squared(mesh, ("expert_dp_shard",) if self.zero else (), exact)
            if self.experts
            else torch.zeros((), dtype=torch.float64, device=self.dense.grad.device)
        )
        # every rank of it takes part, with or without experts
        group = mesh.group("tp_ep_pp")
        experts = group.all_reduce(experts) if group is not None else experts
        norm = (
            self.dense.norm_squared(mesh, ("dp_cp_shard", "mp") if self.zero else ("mp",), exact)
            + experts
        ).sqrt()
        groups = tuple(mesh.group(name) for name in ("dp_cp_shard", "expert_dp_shard"))
        return step_parts(
            self.parts,
            groups,
            norm,
            clip_grad=clip_grad,
            lr=lr,
            weight_decay=weight_decay,
            decoupled_lr=decoupled_lr,
            exact=exact,
        )
