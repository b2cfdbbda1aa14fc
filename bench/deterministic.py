"""What --deterministic-mode costs on CPU: the README's model (default flags) trained for a few
iterations with and without the mode, at one rank, at dp 2 (with and without ZeRO-1) and at tp 2
(with and without sequence parallelism), side by side in this run. Each row's time is the median of
the iterations' elapsed_ms after the first two (metrics.jsonl); every rank computes with one thread
in both modes, as torchrun's workers do.

    python bench/deterministic.py [--iters 8]

Prints each layout's default and deterministic step times and their ratio, and whether the
deterministic rows gave one rank's losses and grad norms bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"

from fmeg.testing.processes import run_in_own_group  # noqa: E402

LAYOUTS = {
    "one rank": (1, []),
    "dp 2": (2, []),
    "dp 2 ZeRO-1": (2, ["--use-distributed-optimizer"]),
    "tp 2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp 2 + sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


def run(tmp: Path, name: str, nproc: int, flags: list[str]) -> list[dict]:
    launcher = ["-m", "fmeg.launch", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    log_dir = tmp / name
    done = run_in_own_group(
        [
            sys.executable,
            *launcher,
            "-m",
            "recipes.gpt_pretrain",
            *flags,
            "--log-dir",
            str(log_dir),
        ],
        1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    common = [
        "--train-iters",
        str(args.iters),
        "--global-batch-size",
        "16",
        "--log-interval",
        "100",
    ]
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout, (nproc, flags) in LAYOUTS.items():
            times = {}
            for mode, extra in (("default", []), ("deterministic", ["--deterministic-mode"])):
                records = run(
                    Path(tmp), f"{layout}-{mode}".replace(" ", "_"), nproc, common + flags + extra
                )
                times[mode] = statistics.median(r["elapsed_ms"] for r in records[2:])
                if mode == "deterministic":
                    curves[layout] = [(r["lm_loss"], r["grad_norm"]) for r in records]
            same = curves[layout] == curves["one rank"]
            print(
                f"{layout}: default {times['default']:.1f} ms, deterministic "
                f"{times['deterministic']:.1f} ms a step, "
                f"{times['deterministic'] / times['default']:.2f}x; one rank's bits: {same}"
            )


if __name__ == "__main__":
    main()
