"""Checkpoints written by fmeg before issue 50's redesign, and the curves that fmeg resumed them on.

    python tests/data/before_redesign/write.py     # rewrites this folder (run by hand, once, before
    the change)

dense_tp2_pp2_bf16_zero: a dense GPT at tp 2 x pp 2, --bf16 with the distributed optimizer, saved at
iteration
3. mla_moe_mtp_ep2: MLA, experts and an MTP depth at dp 2 x ep 2, saved at iteration 3. curves.json
holds, for each, the flags, the losses of iterations 4 to 6 as this fmeg resumed them at the same
layout, and the CPU and torch they were computed with. tests/test_checkpoint_before_redesign.py
resumes each and compares.
"""

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
SMALL = [
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--make-vocab-size-divisible-by",
    "8",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "64",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-iters",
    "6",
    "--log-interval",
    "100",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--save-interval",
    "3",
]
RUNS = {
    "dense_tp2_pp2_bf16_zero": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--bf16",
            "--use-distributed-optimizer",
        ],
    ),
    "mla_moe_mtp_ep2": (
        2,
        [
            "--position-embedding-type",
            "rope",
            "--multi-latent-attention",
            "--kv-lora-rank",
            "16",
            "--qk-head-dim",
            "8",
            "--qk-pos-emb-head-dim",
            "8",
            "--v-head-dim",
            "8",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--moe-aux-loss-coeff",
            "1e-2",
            "--mtp-num-layers",
            "1",
        ],
    ),
}


def run(nproc: int, flags: list[str]) -> list[dict]:
    log = HERE / "_log"
    shutil.rmtree(log, ignore_errors=True)
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    out = subprocess.run(
        [*launcher, "-m", "recipes.gpt_pretrain", *flags, "--log-dir", str(log)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(log)
    return [r for r in records if "lm_loss" in r]


def cpu() -> str:
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    curves = {"cpu": cpu(), "torch": torch.__version__}
    for name, (nproc, flags) in RUNS.items():
        shutil.rmtree(HERE / name, ignore_errors=True)
        run(nproc, [*SMALL, *flags, "--train-iters", "3", "--save", str(HERE / name)])
        resume = HERE / "_resume"
        shutil.copytree(HERE / name, resume)
        records = run(nproc, [*SMALL, *flags, "--train-iters", "6", "--load", str(resume)])
        shutil.rmtree(resume)
        curves[name] = {
            "nproc": nproc,
            "flags": [*SMALL, *flags, "--train-iters", "6"],
            "resumed": [
                {
                    k: v
                    for k, v in r.items()
                    if k in ("iteration", "grad_norm") or k.endswith("loss")
                }
                for r in records
            ],
        }
    (HERE / "curves.json").write_text(json.dumps(curves, indent=1) + "\n")
    print(json.dumps(curves, indent=1))


if __name__ == "__main__":
    main()
