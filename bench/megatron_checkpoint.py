"""What each rank reads of a Megatron-LM torch_dist checkpoint when fmeg resumes it at another
layout.

    python bench/megatron_checkpoint.py

megatron-core itself (tests/harness/megatron_core_run.py, on CPU with gloo) saves a Llama-style
GPTModel (hidden 512, 8 layers, GQA 8/4, SwiGLU FFN 1536, fp32: about 100 MB) at tp 2 x pp 2. Then,
for each fmeg layout, each rank's weights are read as --load reads them
(fmeg.interop.megatron.MegatronCheckpoint through read_params), one rank after another in this
process: the bytes the process read for that rank (/proc/self/io rchar: every read and pread,
.metadata and common.pt included) against the bytes of the weights the rank holds, and against the
bytes a rank would read if it loaded every file it needs whole.

A second table does the same for the distributed optimizer's Adam state (moments and fp32 master
weights) that megatron-core saves, after 2 training steps at tp 2 x dp 2, in its default
dp_reshardable layout (flat buckets per model-parallel rank, no names): what each rank reads to
place the parameters (its master weights checked against the weights) and its shards of the three.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAVED = (2, 2)  # Megatron's tp, pp
# fmeg's tp, pp, dp
TARGETS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1), (2, 4, 1), (1, 1, 2)]


def megatron_core(nproc: int, *args: str) -> None:
    """tests/harness/megatron_core_run.py on nproc gloo ranks (megatron-core itself)."""
    harness = str(ROOT / "tests" / "harness" / "megatron_core_run.py")
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + [f"--nproc-per-node={nproc}", harness, *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def main() -> None:
    import torch

    from fmeg import tree
    from fmeg.checkpoint import latest
    from fmeg.data.tokenizers import padded_vocab_size
    from fmeg.interop.megatron import MegatronCheckpoint, saved_args
    from fmeg.config.checkpoint_args import megatron_model
    from fmeg.parallel.mesh import Mesh
    from fmeg.training.checkpoint_state import read_params
    from fmeg.parallel.layout import Layout

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tp, pp = SAVED
        megatron_core(tp * pp, "save", tmp, "llama_bench", str(tp), str(pp), "1", "100")
        path = latest(tmp)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(
            f"megatron-core's checkpoint at tp {tp} x pp {pp}: {size / 2**20:,.1f} MiB in "
            f"{len(list(path.glob('*.distcp')))} files; torch {torch.__version__}"
        )
        base = megatron_model(saved_args(path), 128)
        # once unmeasured: the imports a first read makes
        with MegatronCheckpoint.open(path, base) as ckpt:
            read_params(ckpt, base, Layout(), Mesh.single())
        print(
            "| fmeg layout | read / held per rank (max, mean) | MiB held per rank (mean) | whole "
            "files a rank needs / held (mean) |"
        )
        print("|---|---|---|---|")
        for tp_, pp_, dp in TARGETS:
            layout = Layout(tp=tp_, pp=pp_, dp=dp)
            config = base.replace(padded_vocab_size=padded_vocab_size(base.vocab_size, tp_, 128))
            ratios, held, whole = [], [], []
            for rank in range(tp_ * pp_ * dp):
                mesh = Mesh.build(rank, tp_ * pp_ * dp, lambda ranks: None, tp=tp_, pp=pp_)
                before = rchar()
                with MegatronCheckpoint.open(path, config) as ckpt:
                    params = read_params(ckpt, config, layout, mesh)
                    files = ckpt.dist.files_read
                read = rchar() - before
                mine = sum(
                    t.numel() * t.element_size()
                    for stage in params.values()
                    for _, t in tree.items(stage)
                )
                ratios.append(read / mine)
                held.append(mine)
                whole.append(sum((path / f).stat().st_size for f in files) / mine)
            print(
                f"| tp {tp_} x pp {pp_} x dp {dp} | {max(ratios):.3f}, "
                f"{statistics.mean(ratios):.3f} | {statistics.mean(held) / 2**20:,.1f} | "
                f"{statistics.mean(whole):.2f} |",
                flush=True,
            )


def optimizer_state() -> None:
    """Each fmeg layout's reads of megatron-core's dp_reshardable Adam state, per rank."""
    from fmeg.checkpoint import latest
    from fmeg.data.tokenizers import padded_vocab_size
    from fmeg.interop.megatron import MegatronCheckpoint, saved_args
    from fmeg.config.checkpoint_args import megatron_model
    from fmeg.parallel.layout import Layout
    from fmeg.parallel.mesh import Mesh
    from fmeg.training.checkpoint_state import read_params
    from fmeg import tree

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        megatron_core(4, "train", tmp, "llama_bench", "2", "1", "1", "2", "dp_reshardable")
        path = latest(tmp)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"\nmegatron-core's checkpoint with Adam state, tp 2 x dp 2: {size / 2**20:,.1f} MiB")
        base = megatron_model(saved_args(path), 128)
        print(
            "| fmeg layout | read / held per rank (max, mean) | MiB of mu, nu, main held (mean) |"
        )
        print("|---|---|---|")
        for tp_, pp_, dp in [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1)]:
            layout = Layout(tp=tp_, pp=pp_, dp=dp)
            config = base.replace(padded_vocab_size=padded_vocab_size(base.vocab_size, tp_, 128))
            ratios, held = [], []
            for rank in range(tp_ * pp_ * dp):
                mesh = Mesh.build(rank, tp_ * pp_ * dp, lambda ranks: None, tp=tp_, pp=pp_)
                before = rchar()
                mine = 0
                with MegatronCheckpoint.open(path, config) as ckpt:
                    assert ckpt.holds_optimizer_state(), ckpt.optimizer_unread()
                    for kind in ("mu", "nu", "main"):
                        for stage in read_params(ckpt, config, layout, mesh, kind=kind).values():
                            mine += sum(t.numel() * 4 for _, t in tree.items(stage))
                ratios.append((rchar() - before) / mine)
                held.append(mine)
            print(
                f"| tp {tp_} x pp {pp_} x dp {dp} | {max(ratios):.3f}, "
                f"{statistics.mean(ratios):.3f} | {statistics.mean(held) / 2**20:,.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
    optimizer_state()
