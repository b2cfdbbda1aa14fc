"""Data-parallel gradient reduction with and without overlap, side by side in one run.

    python bench/overlap.py                       # dp 2 on CPU/gloo, a 12M-parameter GPT
    python bench/overlap.py --nproc 4 --iters 12 --extra --use-distributed-optimizer

Runs recipes.gpt_pretrain under torchrun once per variant (same model, data and seed), reads
metrics.jsonl and prints, per variant, the median iteration time and the median time spent after the
backward pass waiting for gradient reduction (the "grads-reduce" timer), with ratios to the first
variant. The loss curves must agree (overlap changes when collectives start, not what they compute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = [
    "--num-layers",
    "6",
    "--hidden-size",
    "384",
    "--num-attention-heads",
    "6",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "4",
    "--padded-vocab-size",
    "4096",
    "--lr-warmup-iters",
    "1",
    "--log-interval",
    "100",
    "--tensor-model-parallel-size",
    "1",
    "--pipeline-model-parallel-size",
    "1",
    "--device",
    "cpu",
]
VARIANTS = {
    "no overlap (one bucket)": [],
    "no overlap, 1M-element buckets": ["--ddp-bucket-size", "1000000"],
    "overlap, 1M-element buckets": ["--overlap-grad-reduce", "--ddp-bucket-size", "1000000"],
}


def run(name: str, flags: list[str], a, tmp: Path) -> dict:
    log_dir = tmp / name.replace(" ", "_").replace(",", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.nproc}",
        "-m",
        "recipes.gpt_pretrain",
        *MODEL,
        "--train-iters",
        str(a.iters),
        "--global-batch-size",
        str(4 * a.nproc),
        "--log-dir",
        str(log_dir),
        *a.extra,
        *flags,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        sys.exit(out.stdout[-2000:] + out.stderr[-3000:])
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    # the first iterations warm up allocators and groups
    steady = [r for r in records if "lm_loss" in r][2:]
    return {
        "iteration_ms": statistics.median(r["elapsed_ms"] for r in steady),
        "reduce_ms": statistics.median(r["timers_ms"]["grads-reduce"] for r in steady),
        "losses": [r["lm_loss"] for r in records if "lm_loss" in r],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="more runner flags, for every variant"
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, flags, a, Path(tmp)) for name, flags in VARIANTS.items()}
    base = next(iter(results.values()))
    print(
        f"dp {a.nproc}, {a.iters} iterations (median of the last {a.iters - 2}), flags "
        f"{' '.join(a.extra) or '-'}"
    )
    print(f"{'variant':34} {'iteration ms':>13} {'ratio':>6} {'grads-reduce ms':>16} {'ratio':>6}")
    for name, r in results.items():
        print(
            f"{name:34} {r['iteration_ms']:13.1f} {r['iteration_ms'] / base['iteration_ms']:6.2f} "
            f"{r['reduce_ms']:16.1f} {r['reduce_ms'] / max(base['reduce_ms'], 1e-9):6.2f}"
        )
    worst = max(
        abs(x - y) / abs(y) for r in results.values() for x, y in zip(r["losses"], base["losses"])
    )
    print(f"largest relative loss difference between variants: {worst:.1e}")


if __name__ == "__main__":
    main()
