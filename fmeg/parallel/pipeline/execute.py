"""One executor for any schedule: run one rank's actions over pure stage functions.

    loss, grads = execute(actions, stage_fns, stage_params, microbatches, pp_group)

stage_fns[s](params, x, batch) -> the activation sent to stage s + 1, or, for the last stage, that
microbatch's loss (x is None on stage 0, which reads its input from batch); or a list of Segments
(pipeline.segments) that chain to the same. Forward records one autograd graph per segment, from
fresh leaves that share storage with the params and the input, and keeps a vjp function for it (as
torch.func.vjp would; autograd lets a torch.compile'd segment run its compiled backward); backward
calls them in reverse. The last stage's loss is scaled by 1 / M, so the gradients (summed over
microbatches, per local stage) are those of the mean microbatch loss. With grads_into (a
data_parallel.GradSync), each segment's gradients are added into its buffer as each microbatch's
backward produces them, with final=True in the stage's last backward (so data-parallel reduction can
start while the rest runs), instead of being summed here and returned.

Zero-bubble schedules (a W action in the list): the backward is split. The forward runs with
ops.weight_grads.deferrable() and B with deferring(): B computes the input gradient (sent at once)
and the gradients of everything but the linears' weights (the experts' and the FP8 linears' too),
whose products g.T @ x are kept; W computes them and adds the stage's weight gradients to the sum.
The numbers are the same; B does about half the backward's matmuls and W the rest. Compiled
segments run torch's own linears, whose backward B computes whole (W then only hands the gradients
over).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import torch

from fmeg import tree
from fmeg.ops import weight_grads
from fmeg.parallel.pipeline.actions import Action, looped
from fmeg.parallel.pipeline.segments import Segment, as_segments, check_cover, compose, take, units

FORWARD_TAG, BACKWARD_TAG = 0, 1


def _add(total: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Gradient sums are kept in at least fp32, whatever the compute dtype (bf16/fp16
    microbatches)."""
    new = new.to(torch.promote_types(new.dtype, torch.float32))
    return new if total is None else total + new


def vjp(fn: Callable, params: Any, *x: torch.Tensor) -> tuple[torch.Tensor, Callable]:
    """(fn(params, *x), vjp function returning ({path: params cotangent}, *x cotangents)), like
    torch.func.vjp but with the params' cotangents flat by dotted path (what gradient buffers take),
    through autograd: fn runs on detached leaves that require grad, and the vjp function releases
    the graph. The output is detached."""
    leaves, spec = tree.tree_flatten(params)
    inputs = [t.detach().requires_grad_() for t in [*leaves, *x]]
    with torch.enable_grad():
        out = fn(tree.tree_unflatten(inputs[: len(leaves)], spec), *inputs[len(leaves) :])

    def pullback(grad_out: torch.Tensor, deferred: list | None = None) -> tuple:
        """deferred: a list that receives (the returned params cotangents, their deferred weight
        gradients as (path, compute) pairs), the weights' entries left None until W."""
        paths = tree.paths_of(spec)
        if deferred is None:
            grads = torch.autograd.grad(
                out, inputs, grad_out, allow_unused=True, materialize_grads=True
            )
            return (dict(zip(paths, grads[: len(leaves)])), *grads[len(leaves) :])
        pending: list = []
        named = {id(leaf): path for leaf, path in zip(inputs, paths)}
        with weight_grads.deferring(named, pending):
            grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        params_grads = dict(zip(paths, grads[: len(leaves)]))
        deferred.append((params_grads, pending, dict(zip(paths, inputs))))
        x_grads = [
            torch.zeros_like(t) if g is None else g
            for t, g in zip(inputs[len(leaves) :], grads[len(leaves) :])
        ]
        return (params_grads, *x_grads)

    return out.detach(), pullback


@torch.no_grad()
def weight_gradients(deferred: list) -> list[dict[str, torch.Tensor]]:
    """W: each segment's params cotangents with the deferred weight gradients computed and added
    (a leaf no op reached gets zeros)."""
    out = []
    for grads, pending, leaves in deferred:
        for path, compute in pending:
            dw = compute()
            grads[path] = dw if grads[path] is None else grads[path] + dw
        for path, g in grads.items():
            if g is None:
                grads[path] = torch.zeros_like(leaves[path])
        out.append(grads)
    return out


def _always(
    stage: int, keys: tuple[str, ...] | None, backward: bool = False
) -> contextlib.nullcontext:
    """The `use` of params that are always readable."""
    return contextlib.nullcontext()


def _forward(
    segments: list[Segment],
    params: Any,
    x: torch.Tensor | None,
    batch: dict,
    use: Callable = _always,
    stage: int = 0,
    split: bool = False,
) -> tuple:
    """(output, entries) through the chain of segments: (segment, vjp function) for a kept segment,
    and (unit, its input) for a recomputed unit, whose forward keeps nothing else. Each segment runs
    inside use(stage, its keys), which makes its params readable (sharded weights are gathered
    there)."""
    entries: list[tuple] = []
    for unit in units(segments):
        if unit[0].recompute is not None:
            entries.append((unit, x))
            with torch.no_grad():
                x = compose(unit, use, stage)(params, x, batch)
            continue
        (segment,) = unit

        def fn(p, *x, segment=segment):
            return segment.fn(p, x[0] if x else None, batch)

        with use(stage, segment.keys), weight_grads.deferrable() if split else _nothing():
            x, pullback = vjp(fn, take(segment, params), *(() if x is None else (x,)))
        entries.append((segment, pullback))
    return x, entries


def _nothing() -> contextlib.nullcontext:
    return contextlib.nullcontext()


def _backward(
    entries: list,
    grad_out: torch.Tensor,
    params: Any,
    batch: dict,
    use: Callable = _always,
    stage: int = 0,
    deferred: list | None = None,
) -> tuple[torch.Tensor | None, list[dict[str, torch.Tensor]]]:
    """(gradient of the stage input or None on stage 0, [{path: param gradient} per segment, last
    first]). A recomputed unit runs its forward again from its saved input, keeping vjps this time,
    then backward. deferred: B of a split backward (the weight gradients left for W: vjp's
    pullback)."""
    per_segment = []
    for head, saved in reversed(entries):
        if isinstance(head, list):
            kept = [dataclasses.replace(segment, recompute=None) for segment in head]
            # the unit's weights stay gathered from recompute to backward
            with contextlib.ExitStack() as held:
                for segment in head:
                    held.enter_context(use(stage, segment.keys, True))
                _, inner = _forward(kept, params, saved, batch, use, stage, deferred is not None)
                grad_out, grads = _backward(inner, grad_out, params, batch, use, stage, deferred)
            per_segment += grads
            continue
        with use(stage, head.keys, True):
            cotangents = saved(grad_out) if deferred is None else saved(grad_out, deferred)
        per_segment.append(cotangents[0])
        grad_out = cotangents[1] if len(cotangents) > 1 else None
    return grad_out, per_segment


class _Execution:
    """The state of one rank's run of its actions: what each step hands the next, the backward
    functions kept for B, the deferred weight gradients kept for W, and the gradient sums."""

    def __init__(
        self,
        segments: dict,
        stage_params: dict,
        microbatches: list[dict],
        pp_group: Any,
        num_stages: int,
        *,
        loss_scale: float,
        forward_only: bool,
        grads_into: Any,
        divisor: int,
        use: Callable,
        split_backward: bool,
        placement: tuple[int, ...],
    ):
        self.segments, self.params, self.microbatches, self.pp_group = (
            segments,
            stage_params,
            microbatches,
            pp_group,
        )
        # the pipeline rank of each stage
        self.rank_of = placement
        self.last, self.loss_scale, self.forward_only = num_stages - 1, loss_scale, forward_only
        self.grads_into, self.divisor, self.use, self.split_backward = (
            grads_into,
            divisor,
            use,
            split_backward,
        )
        # ("F"/"B", stage, microbatch) -> the input of that step, or the output to send
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.vjps: dict[tuple[int, int], list] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.sums: dict[int, dict[str, torch.Tensor]] = {s: {} for s in stage_params}
        # weight-gradient steps done per stage
        self.finished = {s: 0 for s in stage_params}
        self.loss: torch.Tensor | None = None
        # each microbatch's loss / divisor, in microbatch order (for sums taken exactly)
        self.losses: dict[int, torch.Tensor] = {}

    def run(self, a: Action) -> None:
        s, m, rank_of = a.stage, a.microbatch, self.rank_of
        if a.kind == "RECV_F":
            self.inbox[("F", s, m)] = self.pp_group.recv(rank_of[s - 1], FORWARD_TAG)
        elif a.kind == "RECV_B":
            self.inbox[("B", s, m)] = self.pp_group.recv(rank_of[s + 1], BACKWARD_TAG)
        elif a.kind == "SEND_F":
            self.pp_group.send(self.outbox.pop(("F", s, m)), rank_of[s + 1], FORWARD_TAG)
        elif a.kind == "SEND_B":
            self.pp_group.send(self.outbox.pop(("B", s, m)), rank_of[s - 1], BACKWARD_TAG)
        elif a.kind == "F":
            self.forward(s, m)
        elif a.kind == "B":
            self.backward(s, m)
        elif a.kind == "W":
            self.accumulate(s, weight_gradients(self.deferred.pop((s, m))))

    def forward(self, s: int, m: int) -> None:
        x = None if s == 0 else self.inbox.pop(("F", s, m))
        if self.forward_only:
            with torch.no_grad():
                out = compose(self.segments[s], self.use, s)(
                    self.params[s], x, self.microbatches[m]
                )
        else:
            out, self.vjps[(s, m)] = _forward(
                self.segments[s],
                self.params[s],
                x,
                self.microbatches[m],
                self.use,
                s,
                self.split_backward,
            )
        if s == self.last:
            share = out.detach() / self.divisor
            self.losses[m] = share
            self.loss = (0.0 if self.loss is None else self.loss) + share
        # the next stage is ours: hand over without communication
        elif self.rank_of[s + 1] == self.rank_of[s]:
            self.inbox[("F", s + 1, m)] = out.detach()
        else:
            self.outbox[("F", s, m)] = out.detach()

    def backward(self, s: int, m: int) -> None:
        grad_out = (
            torch.full((), self.loss_scale / self.divisor, device=self.loss.device)
            if s == self.last
            else self.inbox.pop(("B", s, m))
        )
        deferred: list | None = [] if self.split_backward else None
        grad_in, per_segment = _backward(
            self.vjps.pop((s, m)),
            grad_out,
            self.params[s],
            self.microbatches[m],
            self.use,
            s,
            deferred,
        )
        if s > 0:
            if self.rank_of[s - 1] == self.rank_of[s]:
                self.inbox[("B", s - 1, m)] = grad_in
            else:
                self.outbox[("B", s, m)] = grad_in
        if self.split_backward:
            self.deferred[(s, m)] = deferred
        else:
            self.accumulate(s, per_segment)

    def accumulate(self, s: int, per_segment: list[dict[str, torch.Tensor]]) -> None:
        self.finished[s] += 1
        for grads in per_segment:
            if self.grads_into is not None:
                self.grads_into.add(s, grads, final=self.finished[s] == len(self.microbatches))
                continue
            for path, g in grads.items():
                self.sums[s][path] = _add(self.sums[s].get(path), g)


def execute(
    actions: list[Action],
    stage_fns: dict[int, Callable | list[Segment]],
    stage_params: dict[int, Any],
    microbatches: list[dict],
    pp_group: Any,
    num_stages: int,
    trace: list | None = None,
    loss_scale: float = 1.0,
    forward_only: bool = False,
    grads_into: Any = None,
    microbatch_mean: bool = True,
    use: Callable = _always,
    placement: tuple[int, ...] | None = None,
    mean_over: int | None = None,
    loss_per_microbatch: bool = False,
) -> tuple[torch.Tensor | None, dict[int, Any]]:
    """Run `actions` (this rank's list, communication included) and return (mean loss if this rank
    holds the last stage, else None; {stage: gradient of its params}, empty when grads_into takes
    them). A `trace` list receives (action, start, end) in time.perf_counter() seconds for every
    action. loss_scale multiplies the backward seed (fp16 loss scaling); the gradients are of
    loss_scale * mean loss. forward_only (evaluation) runs the F actions without keeping anything
    for a backward. grads_into: an object with add(stage, {path: gradient}, final) that takes the
    gradients instead. microbatch_mean=False: the loss and gradients are of the sum of the
    microbatch losses (per-token losses divide later). use(stage, segment keys, backward) -> a
    context inside which each segment's forward and backward run: where sharded weights are gathered
    (fmeg.parallel.sharded_params). placement: the pipeline rank of each stage (actions.looped,
    Megatron's, by default; actions.v_shape for the V schedules). mean_over: what the microbatch
    mean divides by (default: these microbatches' count; --deterministic-mode gives the global
    batch's, the same seed at every data-parallel size). loss_per_microbatch: the loss returned is
    each microbatch's share of it, stacked in microbatch order, not their float sum."""
    segments = {s: as_segments(stage_fns[s]) for s in stage_params}
    pp = 1 if pp_group is None else pp_group.size
    if not forward_only:
        for s in stage_params:
            check_cover(segments[s], stage_params[s], s)
    run = _Execution(
        segments,
        stage_params,
        microbatches,
        pp_group,
        num_stages,
        loss_scale=loss_scale,
        forward_only=forward_only,
        grads_into=grads_into,
        divisor=(mean_over or len(microbatches)) if microbatch_mean else 1,
        use=use,
        split_backward=any(a.kind == "W" for a in actions),
        placement=placement or looped(pp, -(-num_stages // pp)),
    )
    for a in actions:
        start = time.perf_counter()
        run.run(a)
        if trace is not None:
            trace.append((a, start, time.perf_counter()))
    if pp_group is not None:
        pp_group.finish()
    loss = run.loss
    if loss_per_microbatch and run.losses:
        loss = torch.stack([run.losses[m] for m in sorted(run.losses)])
    if grads_into is not None or forward_only:
        return loss, {}
    return loss, {s: _as_tree(run.sums[s], stage_params[s]) for s in stage_params}


def _as_tree(flat: dict[str, torch.Tensor], like: Any) -> Any:
    spec = tree.tree_flatten(like)[1]
    return tree.tree_unflatten([flat[path] for path, _ in tree.items(like)], spec)
