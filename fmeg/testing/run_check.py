"""The layout check of a run's own flags, as a function: the runner (recipes.gpt_pretrain under
fmeg.launch, gloo ranks on CPU) at one rank and at each layout of fmeg.config.layout_check's plan,
each row's metrics compared with one rank's. python -m fmeg.check prints it as a table.

    plan = layout_check.plan(argv, layouts=["tp2", "pp2-vp2"])
    for row, result in check_run(plan):
        result.differences, result.state_mb, result.failure
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fmeg.config import layout_check
from fmeg.testing.processes import run_in_own_group

# the metrics compared, beside the other losses a record holds
COMPARED = ("lm_loss", "grad_norm")


@dataclass(frozen=True)
class RowResult:
    # {metric: the largest relative difference from one rank over the iterations}
    differences: dict[str, float]
    # each rank's persistent state (weights, gradients, optimizer), MB, in rank order
    state_mb: tuple[float, ...]
    # why the row did not run to its end ("" when it did)
    failure: str = ""

    def differs(self, tolerance: float) -> bool:
        return bool(self.failure) or max(self.differences.values(), default=0.0) > tolerance


def check_run(
    plan: layout_check.Plan, timeout: float = 600
) -> Iterator[tuple[layout_check.Row, RowResult]]:
    """(row, its result) for the one-rank reference (no differences) and then each layout, as each
    run ends; the reference's failure ends the check after it."""
    with tempfile.TemporaryDirectory(prefix="fmeg-check-") as tmp:
        reference = _run(plan.reference, Path(tmp), timeout)
        if isinstance(reference, str):
            yield plan.reference, RowResult({}, (), reference)
            return
        yield plan.reference, RowResult({}, reference["state_mb"])
        for row in plan.rows:
            got = _run(row, Path(tmp), timeout)
            if isinstance(got, str):
                yield row, RowResult({}, (), got)
            else:
                diffs = differences(got["records"], reference["records"])
                yield row, RowResult(diffs, got["state_mb"])


def differences(got: list[dict], want: list[dict]) -> dict[str, float]:
    """{metric: the largest relative difference over the iterations} of the losses and the grad
    norm; inf for a metric one run has and the other lacks, or for runs of different lengths."""
    if len(got) != len(want):
        return {"iterations": math.inf}
    out: dict[str, float] = {}
    for g, w in zip(got, want):
        names = [k for k in w if k in COMPARED or k.endswith("loss") and k != "loss_scale"]
        for name in names:
            value = relative_difference(g.get(name, math.nan), w[name])
            out[name] = max(out.get(name, 0.0), value)
    return out


def relative_difference(got: float, want: float) -> float:
    """|got - want| / |want| (the absolute difference where want is 0); inf where only one is
    finite or either is nan."""
    if got == want:
        return 0.0
    if not (math.isfinite(got) and math.isfinite(want)):
        return math.inf
    return abs(got - want) / (abs(want) or 1.0)


def _run(row: layout_check.Row, tmp: Path, timeout: float) -> dict | str:
    """{"records": each iteration's metrics, "state_mb": each rank's persistent state} of
    one row's run, or the line saying why it failed."""
    log_dir = tmp / re.sub(r"\W", "_", row.name)
    launcher = (
        [sys.executable, "-m", "fmeg.launch", "--standalone", f"--nproc-per-node={row.world}"]
        if row.world > 1
        else [sys.executable]
    )
    argv = [*launcher, "-m", "recipes.gpt_pretrain", *row.argv, "--log-dir", str(log_dir)]
    try:
        proc = run_in_own_group(argv, timeout, env={"OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return f"no result within --timeout {timeout:g} s"
    if proc.returncode != 0:
        last = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        return f"exit {proc.returncode}: {last[-1][:200] if last else 'no output'}"
    metrics = log_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    state = re.search(r"persistent state per rank \(MB\): (.*)", proc.stdout)
    return {
        "records": [r for r in records if "lm_loss" in r],
        "state_mb": tuple(float(x) for x in re.findall(r"r\d+ ([\d.]+)", state[1]))
        if state
        else (),
    }
