"""Measured idle fraction of each pipeline schedule on gloo processes, beside the simulated value.

    python bench/pipeline.py                     # pp=4, 8 microbatches, forward 20 ms per rank-pass
    python bench/pipeline.py --pp 2 --microbatches 16 --forward-ms 10

Stage compute is emulated: a stage's forward sleeps F and its backward sleeps 2F, F for the input
gradient and F for the weight gradient (a chunk of an interleaved rank sleeps 1/v of that); under
the zero-bubble schedule the weight gradient's F runs in W, as the executor defers the linears'
weight gradients. The measurement shows what the schedule and fmeg's executor (buffered sends,
blocking receives over gloo) do, whatever the machine's core count. Idle fraction =
1 - compute time / (ranks * makespan), from per-action timestamps on each rank.
"""

from __future__ import annotations

import argparse
import time

import torch

from fmeg.ops import weight_grads
from fmeg.parallel.pipeline import execute, schedules, simulate
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
    }[name]()


def rank_main(mesh, name: str, m: int, v: int, forward_s: float):
    pp, rank = mesh.size("pp"), mesh.coord("pp")
    chunks = v if name == "interleaved" else 1
    stages = pp * chunks
    schedule = schedules.with_communication(make_schedule(name, pp, m, v))
    # the backward: F for the input gradient and F for the weight gradient
    f_s, b_s = forward_s / chunks, forward_s / chunks

    def stage_fn(stage):
        def run(p, x, batch):
            y = _Sleep.apply(batch["x"] if x is None else x, p, f_s, b_s)
            return y.sum() if stage == stages - 1 else y

        return run

    mine = [s for s in range(stages) if s % pp == rank]
    trace: list = []
    execute.execute(
        schedule[rank],
        {s: stage_fn(s) for s in mine},
        {s: torch.ones(()) for s in mine},
        [{"x": torch.ones(4)} for _ in range(m)],
        mesh.group("pp"),
        stages,
        trace,
    )
    return [(a.is_compute, start, end) for a, start, end in trace]


def measured_idle(traces) -> float:
    start = min(s for t in traces for _, s, _ in t)
    end = max(e for t in traces for _, _, e in t)
    busy = sum(e - s for t in traces for compute, s, e in t if compute)
    return 1.0 - busy / (len(traces) * (end - start))


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
    a = p.parse_args()
    pp, m, v, f = a.pp, a.microbatches, a.chunks, a.forward_ms / 1e3

    print(
        f"pp={pp} microbatches={m} chunks={v} forward={a.forward_ms:.0f} ms "
        f"backward={2 * a.forward_ms:.0f} ms (per rank-pass), gloo on 127.0.0.1, torch "
        f"{torch.__version__}"
    )
    print(
        f"{'schedule':<14} {'simulated idle':>15} {'measured idle':>14} "
        f"{'measured / simulated':>21}"
    )
    with GlooRanks(pp) as ranks:
        for name in ("gpipe", "1f1b", "interleaved", "zero_bubble"):
            chunks = v if name == "interleaved" else 1
            # zero-bubble's B is the input gradient alone, its W the weight gradient
            split = name == "zero_bubble"
            costs = {"F": 1.0 / chunks, "B": (1.0 if split else 2.0) / chunks, "W": float(split)}
            simulated = simulate(make_schedule(name, pp, m, v), costs).bubble_fraction
            runs = [
                measured_idle(ranks.run(rank_main, name, m, v, f, pp=pp)) for _ in range(a.repeats)
            ]
            measured = sorted(runs)[len(runs) // 2]
            print(f"{name:<14} {simulated:>15.3f} {measured:>14.3f} {measured / simulated:>21.3f}")


if __name__ == "__main__":
    main()
