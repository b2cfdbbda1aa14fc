"""One executor for any schedule: run one rank's actions over pure stage functions.

    loss, grads = execute(actions, stage_fns, stage_params, microbatches, pp_group)

stage_fns[s](params, x, batch) -> the activation sent to stage s + 1, or, for the last stage, that
microbatch's loss (x is None on stage 0, which reads its input from batch). Forward uses torch.func.vjp
and keeps the vjp function; backward calls it. The last stage's loss is scaled by 1 / M, so the gradients
returned (summed over microbatches, per local stage) are those of the mean microbatch loss.

Zero-bubble schedules: B sends the input gradient as soon as it is computed and W adds the weight
gradient to the sum. Both come from the one vjp call made at B (torch.func.vjp computes them together),
so W changes when weight gradients are applied, not how much compute B does.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from fmeg import tree
from fmeg.parallel.pipeline.actions import Action

FORWARD_TAG, BACKWARD_TAG = 0, 1


def _add(total: Any, new: Any) -> Any:
    """Gradient sums are kept in at least fp32, whatever the compute dtype (bf16/fp16 microbatches)."""
    new = tree.tree_map(lambda g: g.to(torch.promote_types(g.dtype, torch.float32)), new)
    return new if total is None else tree.tree_map(torch.add, total, new)


def execute(actions: list[Action], stage_fns: dict[int, Callable], stage_params: dict[int, Any],
            microbatches: list[dict], pp_group: Any, num_stages: int,
            trace: list | None = None, loss_scale: float = 1.0,
            forward_only: bool = False) -> tuple[torch.Tensor | None, dict[int, Any]]:
    """Run `actions` (this rank's list, communication included) and return (mean loss if this rank holds
    the last stage, else None; {stage: gradient of its params}). A `trace` list receives
    (action, start, end) in time.perf_counter() seconds for every action. loss_scale multiplies the
    backward seed (fp16 loss scaling); the returned gradients are of loss_scale * mean loss. forward_only
    (evaluation) runs the F actions without keeping anything for a backward."""
    pp = 1 if pp_group is None else pp_group.size
    m_count, last = len(microbatches), num_stages - 1
    inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"/"B", stage, microbatch) -> input of that step
    outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"/"B", stage, microbatch) -> output to send
    vjps: dict[tuple[int, int], Callable] = {}
    deferred: dict[tuple[int, int], Any] = {}
    grads: dict[int, Any] = {s: None for s in stage_params}
    loss = None
    split_backward = any(a.kind == "W" for a in actions)

    for a in actions:
        start = time.perf_counter()
        s, m = a.stage, a.microbatch
        if a.kind == "RECV_F":
            inbox[("F", s, m)] = pp_group.recv((s - 1) % pp, FORWARD_TAG)
        elif a.kind == "RECV_B":
            inbox[("B", s, m)] = pp_group.recv((s + 1) % pp, BACKWARD_TAG)
        elif a.kind == "SEND_F":
            pp_group.send(outbox.pop(("F", s, m)), (s + 1) % pp, FORWARD_TAG)
        elif a.kind == "SEND_B":
            pp_group.send(outbox.pop(("B", s, m)), (s - 1) % pp, BACKWARD_TAG)
        elif a.kind == "F":
            fn, batch = stage_fns[s], microbatches[m]
            if forward_only:
                with torch.no_grad():
                    out = fn(stage_params[s], None if s == 0 else inbox.pop(("F", s, m)), batch)
                vjp = None
            elif s == 0:
                out, vjp = torch.func.vjp(lambda p: fn(p, None, batch), stage_params[s])
            else:
                x = inbox.pop(("F", s, m))
                out, vjp = torch.func.vjp(lambda p, x: fn(p, x, batch), stage_params[s], x)
            if vjp is not None:
                vjps[(s, m)] = vjp
            if s == last:
                loss = (0.0 if loss is None else loss) + out.detach() / m_count
            elif (s + 1) % pp == s % pp:  # the next stage is ours: hand over without communication
                inbox[("F", s + 1, m)] = out.detach()
            else:
                outbox[("F", s, m)] = out.detach()
        elif a.kind == "B":
            grad_out = torch.full((), loss_scale / m_count) if s == last else inbox.pop(("B", s, m))
            cotangents = vjps.pop((s, m))(grad_out)
            if s > 0:
                target = inbox if (s - 1) % pp == s % pp else outbox
                target[("B", s - 1, m) if target is inbox else ("B", s, m)] = cotangents[1]
            if split_backward:
                deferred[(s, m)] = cotangents[0]
            else:
                grads[s] = _add(grads[s], cotangents[0])
        elif a.kind == "W":
            grads[s] = _add(grads[s], deferred.pop((s, m)))
        if trace is not None:
            trace.append((a, start, time.perf_counter()))
    if pp_group is not None:
        pp_group.finish()
    return loss, grads
