"""FP8 against bf16 over the main job's model: the README's run (its default model on the embedded
data) trained at one rank for 200 iterations in bf16, and with each FP8 recipe (hybrid) on top,
side by side; prints each recipe's largest and final relative distance from the bf16 curve.

    python bench/fp8_curves.py [--iters 200] [--recipes tensorwise delayed blockwise mxfp8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def curve(flags: list[str], iters: int, where: Path) -> tuple[list[float], float]:
    """(the lm loss of each iteration, seconds) of the recipe at one rank."""
    where.mkdir(parents=True)
    argv = [sys.executable, "-m", "recipes.gpt_pretrain", "--train-iters", str(iters)]
    argv += ["--log-interval", str(iters), "--log-dir", str(where), "--bf16", *flags]
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    return [r["lm_loss"] for r in records if "lm_loss" in r], seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--recipes", nargs="*", default=["tensorwise", "delayed", "blockwise", "mxfp8"])
    a = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        base, seconds = curve([], a.iters, Path(tmp) / "bf16")
        print(f"bf16: final loss {base[-1]:.4f} ({seconds:.0f} s)")
        print(
            f"{'recipe':<12} {'largest':>9} {'at':>5} {'final':>9} {'mean last 20':>13} "
            f"{'seconds':>8}"
        )
        for recipe in a.recipes:
            flags = ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
            got, seconds = curve(flags, a.iters, Path(tmp) / recipe)
            rel = [abs(g - b) / b for g, b in zip(got, base, strict=True)]
            tail = sum(got[-20:]) / 20 - sum(base[-20:]) / 20
            at = rel.index(max(rel)) + 1
            out[recipe] = {"largest": max(rel), "at": at, "final": rel[-1], "tail": tail / base[-1]}
            print(
                f"{recipe:<12} {max(rel):>9.2e} {at:>5} {rel[-1]:>9.2e} {tail / base[-1]:>+13.2e} "
                f"{seconds:>8.0f}"
            )
    return out


if __name__ == "__main__":
    main()
