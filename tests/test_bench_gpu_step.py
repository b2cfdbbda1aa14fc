"""bench/gpu_step.py runs as written at a tiny shape on CPU (its GPU shapes are for machines with
one)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_gpu_step_bench_smoke_run_on_cpu():
    out = subprocess.run(
        [
            sys.executable,
            "bench/gpu_step.py",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--no-compile",
            "--sharding",
            "optim_grads_params",
            "--mla",
            "--muon",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^fmeg runner +\d+\.\d", out.stdout, re.M)
    assert re.search(r"^nanoGPT-style peer +\d+\.\d", out.stdout, re.M)
    assert float(re.search(r"throughput ratio fmeg / peer: (\d+\.\d+)", out.stdout).group(1)) > 0
    assert float(re.search(r"step time muon / adamw: (\d+\.\d+)", out.stdout).group(1)) > 0
    assert (
        float(re.search(r"step time optim_grads_params / runner: (\d+\.\d+)", out.stdout).group(1))
        > 0
    )
    assert float(re.search(r"step time MLA / GQA: (\d+\.\d+)", out.stdout).group(1)) > 0


def test_moe_step_bench_smoke_run_on_cpu():
    """bench/moe_step.py (an MoE step against a dense step of the same active parameters) runs as
    written."""
    out = subprocess.run(
        [sys.executable, "bench/moe_step.py", "--shape", "tiny", "--steps", "1", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^ +moe: +\d+\.\d ms/step", out.stdout, re.M)
    assert float(re.search(r"dense / moe step time: (\d+\.\d+)x", out.stdout).group(1)) > 0
