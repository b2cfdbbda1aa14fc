"""What the test suite's warm pool saves: the README's tiny model (the harness's flags, 20
iterations) run as a fresh process (one rank) or under torchrun (tp 2 on two ranks), against the
same run forked from fmeg.testing.warm_pool's server, side by side in this run; the pool's server
is started (and its imports paid) before the timing.

    python bench/warm_pool.py [--repeats 3]

Prints, per layout, the median wall time of each way, their ratio, and whether the metrics agree
bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from harness.runner import COMMON  # noqa: E402

from fmeg.testing.processes import run_in_own_group  # noqa: E402
from fmeg.testing.warm_pool import WarmPool  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def metrics(log_dir: Path) -> list:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r.get("lm_loss"), r.get("grad_norm")) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pool = WarmPool(preload=["recipes.gpt_pretrain"])
    pool.run("recipes.gpt_pretrain", ["--help"], 1, 600)
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, flags in ((1, []), (2, ["--tensor-model-parallel-size", "2"])):
            times: dict[str, list[float]] = {"fresh": [], "warm": []}
            for i in range(args.repeats):
                for way in times:
                    log_dir = Path(tmp) / f"{way}{nproc}_{i}"
                    argv = [*COMMON, *flags, "--log-dir", str(log_dir)]
                    start = time.perf_counter()
                    if way == "warm":
                        done = pool.run("recipes.gpt_pretrain", argv, nproc, 600)
                    else:
                        launcher = (
                            [*TORCHRUN, f"--nproc-per-node={nproc}"]
                            if nproc > 1
                            else [sys.executable]
                        )
                        done = run_in_own_group(
                            [*launcher, "-m", "recipes.gpt_pretrain", *argv], 600
                        )
                    times[way].append(time.perf_counter() - start)
                    assert done.returncode == 0, done.stderr[-2000:]
            same = metrics(Path(tmp) / f"fresh{nproc}_0") == metrics(Path(tmp) / f"warm{nproc}_0")
            fresh, warm = (statistics.median(times[w]) for w in ("fresh", "warm"))
            print(
                f"{nproc} rank(s): fresh {fresh:.2f} s, warm pool {warm:.2f} s, "
                f"{fresh / warm:.2f}x; metrics bit for bit: {same}"
            )
    pool.close()


if __name__ == "__main__":
    main()
