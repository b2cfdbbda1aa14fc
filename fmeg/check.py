"""Check that your own run trains the same at every layout as on one rank, on this machine's CPU.

    python -m fmeg.check <your Megatron flags, or --config run.yaml> [--layouts tp2,pp2-vp2,...]
        [--iterations 5] [--tolerance 1e-5] [--no-shrink] [--keep-precision] [--max-ranks 4]

The model is shrunk unless --no-shrink (each flag shrunk is named), the run's own layout,
checkpoints and loggers are left out, and each layout the flags allow (or each one named) runs
the real runner, recipes.gpt_pretrain under fmeg.launch with gloo ranks, for a few iterations.
One row per layout: the largest relative difference from one rank, over the iterations, of the
loss, of the other losses (MoE balance, MTP) and of the gradient norm; each rank's persistent state
(weights, gradients, optimizer); and a verdict. The exit code is 1 when a row differs by more than
the tolerance or fails to run, 2 when the flags or the layouts asked for are not valid (one line
each).
"""

from __future__ import annotations

import math
import signal
import sys
import time

from fmeg.cli import OneLineParser, print_refusal


def main(argv: list[str] | None = None) -> int:
    own, megatron = _parser().parse_known_args(argv)
    problems = _own_problems(own)
    if problems:
        print_refusal(problems)
        return 2
    # after the parse: --help and a bad option of the check's own answer without importing torch
    from fmeg.config import layout_check

    layouts = [n for n in own.layouts.split(",") if n] if own.layouts else None
    try:
        plan = layout_check.plan(
            megatron,
            layouts=layouts,
            iterations=own.iterations,
            shrink=own.shrink,
            keep_precision=own.keep_precision,
            max_ranks=own.max_ranks,
        )
    except layout_check.PlanError as e:
        print_refusal(e.lines)
        return 2
    for line in layout_check.describe(plan):
        print(line, flush=True)
    # SIGTERM unwinds as Ctrl-C does: the running layout's ranks are killed and the temporary
    # directories removed on the way out
    signal.signal(signal.SIGTERM, _terminated)
    # and Ctrl-C stops it even where the caller ignores SIGINT (a child started from a background
    # job or a test runner's worker inherits the ignoring)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _rows(plan, own)
    except KeyboardInterrupt:
        print("error: stopped by Ctrl-C; the running layout's ranks were stopped", file=sys.stderr)
        return 130
    except _Terminated:
        print("error: stopped by SIGTERM; the running layout's ranks were stopped", file=sys.stderr)
        return 128 + signal.SIGTERM


class _Terminated(Exception):
    pass


def _terminated(signum, frame):
    raise _Terminated


def _rows(plan, own) -> int:
    """Run the plan's rows, printing the table as they end and a progress line on stderr as each
    starts and ends; the exit code."""
    from fmeg.testing.run_check import check_run

    rows = [plan.reference, *plan.rows]
    failed, done, started = [], 0.0, time.monotonic()
    _progress(f"[1/{len(rows)}] running 1 rank ...")
    for i, (row, result) in enumerate(check_run(plan, own.timeout)):
        if row is plan.reference and result.failure:
            print(f"error: the one-rank run failed: {result.failure}", file=sys.stderr, flush=True)
            return 1
        if row is plan.reference:
            print(_header(), flush=True)
            verdict = "reference"
        elif result.failure:
            verdict = f"FAILED to run: {result.failure}"
        else:
            verdict = "DIFFERS" if result.differs(own.tolerance) else "same"
        if row is not plan.reference and result.differs(own.tolerance):
            failed.append(row.name)
        print(_line(row.name, row.world, result.differences, result.state_mb, verdict), flush=True)
        done += row.world
        elapsed = time.monotonic() - started
        left = rows[i + 1 :]
        # a row's time grows about with its ranks (each a process on the same cores)
        estimate = elapsed / done * sum(r.world for r in left)
        _progress(
            f"[{i + 1}/{len(rows)}] {row.name} done; {elapsed:.0f} s so far"
            + (
                f", about {_duration(estimate)} left; [{i + 2}/{len(rows)}] running "
                f"{left[0].name} on {left[0].world} ranks ..."
                if left
                else ""
            )
        )
    if failed:
        print(
            f"differ from one rank beyond {own.tolerance:g}: {', '.join(failed)}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    print(f"every layout equals one rank within {own.tolerance:g}", flush=True)
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _own_problems(own) -> list[str]:
    """A line for each of the check's own options that cannot mean what it says."""
    out = []
    if own.iterations < 1:
        out.append(f"--iterations must be at least 1, got {own.iterations}")
    if not (math.isfinite(own.tolerance) and own.tolerance >= 0):
        out.append(f"--tolerance must be a finite number >= 0, got {own.tolerance:g}")
    if own.max_ranks < 2:
        out.append(
            f"--max-ranks must be at least 2 (a layout has 2 or more ranks), got {own.max_ranks}"
        )
    if not (math.isfinite(own.timeout) and own.timeout > 0):
        out.append(f"--timeout must be a number of seconds above 0, got {own.timeout:g}")
    return out


def _parser() -> OneLineParser:
    p = OneLineParser(
        prog="python -m fmeg.check",
        description="Run your flags at each layout on CPU and compare the curves with one rank's; "
        "every other flag is the runner's (recipes.gpt_pretrain).",
    )
    p.add_argument(
        "--layouts",
        help="comma-separated layouts, e.g. tp2,pp2-vp2,dp2-zero (default: each layout the flags "
        "allow within --max-ranks)",
    )
    p.add_argument(
        "--iterations", type=int, default=5, help="iterations per layout (default: %(default)s)"
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-5,
        help="largest relative difference (default: %(default)s)",
    )
    p.add_argument(
        "--no-shrink",
        dest="shrink",
        action="store_false",
        help="the model as given (default: shrunk)",
    )
    p.add_argument(
        "--keep-precision", action="store_true", help="keep --bf16 / --fp16 (default: fp32)"
    )
    p.add_argument(
        "--max-ranks", type=int, default=4, help="the largest world run (default: %(default)s)"
    )
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds per layout (default: %(default)s)"
    )
    return p


def _header() -> str:
    return (
        f"{'layout':<16} {'ranks':>5}  {'lm loss':>9}  {'other losses':>12}  {'grad norm':>9}  "
        f"{'state MB per rank':<24}  verdict"
    )


def _line(name: str, world: int, diffs: dict, state_mb: tuple, verdict: str) -> str:
    """A row: each difference as the largest relative one (blank for the reference)."""

    def shown(value: float | None) -> str:
        return "" if value is None else f"{value:.1e}"

    from fmeg.testing.run_check import COMPARED

    others = [v for k, v in diffs.items() if k not in COMPARED and k != "iterations"]
    state = " ".join(f"{mb:.2f}" for mb in state_mb)
    return (
        f"{name:<16} {world:>5}  {shown(diffs.get('lm_loss')):>9}  "
        f"{shown(max(others) if others else None):>12}  {shown(diffs.get('grad_norm')):>9}  "
        f"{state:<24}  {verdict}"
    )


if __name__ == "__main__":
    sys.exit(main())
