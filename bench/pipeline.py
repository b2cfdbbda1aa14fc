"""Measured idle fraction of each pipeline schedule on gloo processes, beside the simulated value.

    python bench/pipeline.py                     # pp=4, 8 microbatches, forward 20 ms per rank-pass
    python bench/pipeline.py --pp 2 --microbatches 16 --forward-ms 10

Stage compute is emulated: a stage's forward sleeps F and its backward sleeps 2F, F for the input
gradient and F for the weight gradient (a chunk of an interleaved rank sleeps 1/v of that, a chunk
of the V schedules ZB-V and DualPipeV 1/2); under the zero-bubble schedules the weight gradient's
F runs in W, as the executor defers the linears' weight gradients. The measurement shows what the
schedule and fmeg's executor (buffered sends, blocking receives over gloo) do, whatever the
machine's core count. Idle fraction = 1 - compute time / (ranks * makespan), from per-action
timestamps on each rank.
"""

from __future__ import annotations

import argparse
import time

import torch

from fmeg.ops import weight_grads
from fmeg.parallel.pipeline import execute, schedules, simulate
from fmeg.parallel.pipeline.actions import placement_of
from fmeg.parallel.spmd import GlooRanks


class _Sleep(torch.autograd.Function):
    """x * p whose forward takes forward_s and whose backward takes backward_s for the input
    gradient and as long again for p's gradient, which a split backward defers to W
    (ops.weight_grads.defer, as the linears do)."""

    @staticmethod
    def forward(x, p, forward_s, backward_s):
        time.sleep(forward_s)
        return x * p

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, p, _, ctx.backward_s = inputs
        ctx.save_for_backward(x, p)

    @staticmethod
    def backward(ctx, grad):
        x, p = ctx.saved_tensors
        time.sleep(ctx.backward_s)

        def compute(grad=grad, x=x, seconds=ctx.backward_s):
            time.sleep(seconds)
            return (grad * x).sum()

        return grad * p, None if weight_grads.defer(p, compute) else compute(), None, None


def make_schedule(name: str, pp: int, m: int, v: int):
    return {
        "gpipe": lambda: schedules.gpipe(pp, m),
        "1f1b": lambda: schedules.one_f_one_b(pp, m),
        "interleaved": lambda: schedules.interleaved_1f1b(pp, m, v),
        "zero_bubble": lambda: schedules.zero_bubble_h1(pp, m),
        "zero_bubble_v": lambda: schedules.zero_bubble_v(pp, m),
        "dualpipe_v": lambda: schedules.dualpipe_v(pp, m),
    }[name]()


def chunks_of(name: str, v: int) -> int:
    """Model chunks per rank: v for interleaved 1F1B, 2 for the V schedules, else 1."""
    return {"interleaved": v, "zero_bubble_v": 2, "dualpipe_v": 2}.get(name, 1)


# the schedules whose backward is split into B and W
SPLIT = ("zero_bubble", "zero_bubble_v", "dualpipe_v")


def rank_main(mesh, name: str, m: int, v: int, forward_s: float):
    pp, rank = mesh.size("pp"), mesh.coord("pp")
    chunks = chunks_of(name, v)
    stages = pp * chunks
    schedule = schedules.with_communication(make_schedule(name, pp, m, v))
    placement = placement_of(schedule)
    # the backward: F for the input gradient and F for the weight gradient
    f_s, b_s = forward_s / chunks, forward_s / chunks

    def stage_fn(stage):
        def run(p, x, batch):
            y = _Sleep.apply(batch["x"] if x is None else x, p, f_s, b_s)
            return y.sum() if stage == stages - 1 else y

        return run

    mine = [s for s in range(stages) if placement[s] == rank]
    trace: list = []
    execute.execute(
        schedule[rank],
        {s: stage_fn(s) for s in mine},
        {s: torch.ones(()) for s in mine},
        [{"x": torch.ones(4)} for _ in range(m)],
        mesh.group("pp"),
        stages,
        trace,
        placement=placement,
    )
    return [(a.kind, start, end) for a, start, end in trace]


def one_way_latency(mesh, rounds: int = 50) -> float:
    """Seconds from a send on pipeline rank 0 to its receive on rank 1 (half the median round
    trip of a 4-element message through the executor's send and recv)."""
    group, rank = mesh.group("pp"), mesh.coord("pp")
    x, trips = torch.ones(4), []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            group.send(x, 1, 7)
            group.recv(1, 7)
        elif rank == 1:
            group.send(group.recv(0, 7), 0, 7)
        trips.append(time.perf_counter() - start)
    group.finish()
    return sorted(trips)[rounds // 2] / 2


def measured_idle(traces) -> float:
    start = min(s for t in traces for _, s, _ in t)
    end = max(e for t in traces for _, _, e in t)
    busy = sum(e - s for t in traces for kind, s, e in t if kind in "FBW")
    return 1.0 - busy / (len(traces) * (end - start))


def measured_costs(traces, unit: float) -> dict[str, float]:
    """The mean duration of each compute kind over every rank, in units of `unit` seconds."""
    costs = {}
    for kind in "FBW":
        spans = [e - s for t in traces for k, s, e in t if k == kind]
        costs[kind] = sum(spans) / len(spans) / unit if spans else 0.0
    return costs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument(
        "--chunks", type=int, default=2, help="model chunks per rank for the interleaved schedule"
    )
    p.add_argument("--forward-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "1f1b", "interleaved", "zero_bubble", "zero_bubble_v", "dualpipe_v"],
    )
    a = p.parse_args()
    pp, m, v, f = a.pp, a.microbatches, a.chunks, a.forward_ms / 1e3

    print(
        f"pp={pp} microbatches={m} chunks={v} forward={a.forward_ms:.0f} ms "
        f"backward={2 * a.forward_ms:.0f} ms (per rank-pass), gloo on 127.0.0.1, torch "
        f"{torch.__version__}"
    )
    with GlooRanks(pp) as ranks:
        latency = ranks.run(one_way_latency, pp=pp)[0]
        print(
            f"one-way message latency {latency * 1e3:.2f} ms. Idle fraction simulated (nominal "
            "costs; with that latency; with it and the measured mean cost of each F, B and W) "
            f"and measured:\n{'schedule':<14} {'nominal':>9} {'latency':>9} {'replayed':>9} "
            f"{'measured':>9}"
        )
        for name in a.schedules:
            chunks = chunks_of(name, v)
            # zero-bubble's B is the input gradient alone, its W the weight gradient
            split = name in SPLIT
            costs = {
                "F": 1.0 / chunks,
                "B": (1.0 if split else 2.0) / chunks,
                "W": float(split) / chunks,
            }
            schedule = make_schedule(name, pp, m, v)
            simulated = simulate(schedule, costs).bubble_fraction
            # in units of one rank-pass's forward
            with_latency = simulate(schedule, costs, latency=latency / f).bubble_fraction
            # the first run also opens gloo's connections: not measured
            ranks.run(rank_main, name, m, v, f, pp=pp)
            runs = sorted(
                (ranks.run(rank_main, name, m, v, f, pp=pp) for _ in range(a.repeats)),
                key=measured_idle,
            )
            median = runs[len(runs) // 2]
            measured = measured_idle(median)
            replayed = simulate(
                schedule, measured_costs(median, f), latency=latency / f
            ).bubble_fraction
            print(
                f"{name:<14} {simulated:>9.3f} {with_latency:>9.3f} {replayed:>9.3f} "
                f"{measured:>9.3f}"
            )


if __name__ == "__main__":
    main()
