"""Checkpoints at scale on CPU: what resuming reads and holds per rank, and how long a save stalls
training.

    python bench/checkpoint.py [--only reshard|stall] [--hidden 384] [--layers 8]

Resharding: a mixture-of-experts GPT (hidden 384, 8 layers of 8 experts, top-2; bf16 with the
distributed optimizer: a checkpoint of about 600 MB) trained one iteration and saved by the runner
on 8 gloo ranks (tp 2 x pp 2 x ep 2, sequence parallel), then restored by the runner's
build_or_restore at 4 and 16 ranks in several tp / pp / dp / ep / cp mixes. Per rank: the bytes the
process read while restoring (/proc/self/io's rchar: every read() and pread(), the metadata
included) against the bytes of the state it holds (the weights in bf16, and its slices of the fp32
master and Adam's moments), and the peak resident memory of the process with the load against the
same layout started fresh (both taken right after build_or_restore).

Save stall: one rank training a dense GPT (hidden 768, 6 layers, fp32: a checkpoint of about 500 MB)
on one sequence of 32 tokens per iteration (so that the save is large next to the step), with a save
every 4 iterations: the wall time of the iterations that save, and of those that run while a save is
written, against those before the first save, synchronous against --async-save, in the same run of
this script.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOE = [
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--bf16",
    "--use-distributed-optimizer",
    "--seq-length",
    "256",
    "--max-position-embeddings",
    "256",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--num-attention-heads",
    "8",
    "--device",
    "cpu",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1",
]
SAVED_AT = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--expert-model-parallel-size",
    "2",
    "--sequence-parallel",
]
TARGETS = {  # name: (ranks, flags)
    "4: tp 1 x pp 1 x dp 4, ep 4": (4, ["--expert-model-parallel-size", "4"]),
    "4: cp 2 x dp 2, ep 2": (
        4,
        ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"],
    ),
    "16: tp 2 x pp 2 x dp 4, ep 4": (
        16,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "4",
            "--sequence-parallel",
        ],
    ),
    "16: tp 4 x pp 2 x dp 2, ep 2": (
        16,
        [
            "--tensor-model-parallel-size",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
    ),
    "16: cp 2 x pp 4 x dp 2, ep 4": (
        16,
        [
            "--context-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "4",
            "--expert-model-parallel-size",
            "4",
        ],
    ),
}


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(argv: list[str], out: str, train: bool) -> None:
    """One rank: the runner's phases (recipes.gpt_pretrain.main), measured around build_or_restore,
    and with train, the wall time of each iteration (a save's time falls in its iteration's)."""
    import torch

    from fmeg.config.arguments import parse_args
    from fmeg.training.run_state import Checkpointer, build_or_restore
    from fmeg.training.session import Session
    from fmeg.training.trainer import Trainer
    from recipes.gpt_pretrain import prepare

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, train_data, valid_data = prepare(parse_args(argv), world)
    session = Session.start(cfg)
    torch.manual_seed(cfg.training.seed)
    read_before = rchar()
    started = time.perf_counter()
    state, progress, said = build_or_restore(cfg, session)
    record = {
        "rank": session.rank,
        "read": rchar() - read_before,
        "seconds": time.perf_counter() - started,
        "peak_rss": peak_rss(),
        "said": said,
        "held": sum(
            b.numel() * b.element_size() for part in state.parts for b, _ in part.buffers().values()
        ),
    }
    if train:
        saver = Checkpointer(cfg, session) if cfg.checkpoint.save else None
        trainer = Trainer(cfg, session, state, progress, train_data, valid_data, saver, time.time())
        starts, iterate = [], trainer.iterate
        trainer.iterate = lambda i: (starts.append(time.perf_counter()), iterate(i))[1]
        trainer.run()
        starts.append(time.perf_counter())
        record["iteration_s"] = [b - a for a, b in zip(starts, starts[1:])]
    Path(out, f"rank_{session.rank:05d}.json").write_text(json.dumps(record))
    session.close()


def launch(nproc: int, flags: list[str], out: Path, train: bool = False) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        *(["--train"] if train else []),
        "--",
        *flags,
    ]
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    if done.returncode:
        raise SystemExit(
            f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return sorted(
        (json.loads(p.read_text()) for p in out.glob("rank_*.json")), key=lambda r: r["rank"]
    )


def reshard(work: Path, model: list[str]) -> None:
    ckpt = work / "ckpt"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=8",
            "-m",
            "recipes.gpt_pretrain",
            *model,
            *SAVED_AT,
            "--train-iters",
            "1",
            "--save",
            str(ckpt),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    print(f"checkpoint saved at 8 ranks ({' '.join(SAVED_AT)}): {size / 2**20:,.0f} MiB")
    print(
        "| resumed at | read / held per rank (max, mean) | MiB held per rank (mean) | peak RSS, "
        "resumed - fresh (MiB, max) | (resumed - fresh) / held (max) | restore s (max) |"
    )
    print("|---|---|---|---|---|---|")
    for name, (nproc, flags) in TARGETS.items():
        for mode in ("", " fully parallel") if name.startswith("16: tp 2") else ("",):
            extra = ["--ckpt-fully-parallel-load"] if mode else []
            resumed = launch(
                nproc,
                [*model, *flags, *extra, "--load", str(ckpt), "--train-iters", "2"],
                work / f"{name}{mode}".replace(" ", "_").replace(":", "").replace(",", ""),
            )
            fresh = launch(
                nproc,
                [*model, *flags, "--train-iters", "2"],
                work / f"fresh_{name}".replace(" ", "_").replace(":", "").replace(",", ""),
            )
            ratios = [r["read"] / r["held"] for r in resumed]
            added = [a["peak_rss"] - b["peak_rss"] for a, b in zip(resumed, fresh)]
            print(
                f"| {name}{mode} | {max(ratios):.3f}, {statistics.mean(ratios):.3f} | "
                f"{statistics.mean(r['held'] for r in resumed) / 2**20:,.1f} | "
                f"{max(added) / 2**20:+,.0f} | "
                f"{max(a / r['held'] for a, r in zip(added, resumed)):+.2f} | "
                f"{max(r['seconds'] for r in resumed):.1f} |",
                flush=True,
            )
            shutil.rmtree(
                work / f"fresh_{name}".replace(" ", "_").replace(":", "").replace(",", "")
            )


def stall(work: Path, hidden: int, layers: int) -> None:
    dense = [
        "--hidden-size",
        str(hidden),
        "--num-layers",
        str(layers),
        "--num-attention-heads",
        "12",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--train-iters",
        "15",
        "--save-interval",
        "4",
        "--device",
        "cpu",
        "--log-interval",
        "100",
    ]
    print(
        "| save | iteration before any save, ms (median of 1-3) | iteration that saves / before "
        "(median of 4, 8, 12) | iterations while the save is written / before (median of 5-7, "
        "9-11, 13-14) | checkpoint MiB |"
    )
    print("|---|---|---|---|---|")
    for name, extra in (("synchronous", []), ("--async-save", ["--async-save"])):
        ckpt = work / f"stall_{name.strip('-')}"
        (record,) = launch(
            1,
            [*dense, *extra, "--save", str(ckpt)],
            work / f"stall_log_{name.strip('-')}",
            train=True,
        )
        # t[i - 1]: iteration i; 4, 8 and 12 save, and 15 at the end (waiting for it)
        t = record["iteration_s"]
        before = statistics.median(t[0:3])
        saving = statistics.median([t[3], t[7], t[11]])
        after = statistics.median(t[4:7] + t[8:11] + t[12:14])
        size = sum(f.stat().st_size for f in (ckpt / "iter_0000004").iterdir())
        print(
            f"| {name} | {before * 1e3:,.0f} | {saving / before:.2f} | {after / before:.2f} | "
            f"{size / 2**20:,.0f} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", choices=["reshard", "stall"])
    p.add_argument("--hidden", type=int, default=384, help="the resharded model's hidden size")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.worker:
        return worker(rest[1:] if rest[:1] == ["--"] else rest, a.worker, a.train)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        if a.only in (None, "reshard"):
            reshard(
                Path(tmp),
                [
                    *MOE,
                    "--hidden-size",
                    str(a.hidden),
                    "--num-layers",
                    str(a.layers),
                    "--moe-ffn-hidden-size",
                    str(2 * a.hidden),
                ],
            )
        if a.only in (None, "stall"):
            stall(Path(tmp), 768, 6)


if __name__ == "__main__":
    main()
