"""Fully sharded data parallelism on CPU: each strategy's persistent bytes per parameter, peak
memory per rank and step time at dp 4 (gloo processes), bf16 weights with fp32 master weights and
gradients.

    # 12 layers, hidden 768, vocab 32000: 117M parameters
    python bench/fsdp_cpu.py
    python bench/fsdp_cpu.py --layers 2 --hidden 256 --heads 8 --steps 2    # a quicker look

Each strategy runs on four fresh gloo processes (so one strategy's peak cannot hide another's), the
same weights and batches. The state is built as the runner builds it, a layer at a time
(initialized_state); the init peak is the resident high-water mark (VmHWM) while it is built, less
the resident size before, next to the whole model's fp32 size that building it whole on each rank
would add. The step peak is the high-water mark over the timed steps, reset after the state is
built, less the resident size just before the steps' first allocation; the state figure is the
persistent buffers' bytes. Prints a table and each strategy's ratios to no_shard, measured in the
same run. The last row is the distributed optimizer with Megatron's precision-aware optimizer's bf16
moments (--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16). A second
table counts what rank 0 sends over its data-parallel group in the last timed step (the recording
communicator: each kind of collective, its number and its logical volume, the whole tensor it
works on).
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch

# (row, sharding, Adam's moments' dtype)
STRATEGIES = (
    ("no_shard", "no_shard", torch.float32),
    ("optim", "optim", torch.float32),
    ("optim_grads", "optim_grads", torch.float32),
    ("optim_grads_params", "optim_grads_params", torch.float32),
    ("optim, bf16 moments", "optim", torch.bfloat16),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=2, help="per rank and step")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    return p.parse_args()


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    # the high-water mark back to the current resident size
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rank_program(
    mesh, sharding: str, moments: torch.dtype, sizes: dict, microbatches: int, steps: int
) -> dict:
    from fmeg.models import gpt
    from fmeg.parallel.comm import RecordingGroup
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import initialized_state, train_iteration
    from fmeg.training.step_settings import StepSettings

    torch.set_num_threads(1)
    config = gpt.GPTConfig.gpt2(
        vocab_size=sizes["vocab"],
        max_seq_len=sizes["seq"],
        num_layers=sizes["layers"],
        hidden_size=sizes["hidden"],
        num_heads=sizes["heads"],
    )
    layout = Layout(dp=mesh.size("dp"), sharding=sharding)
    wire = mesh.comms["dp_cp_shard"] = RecordingGroup(mesh.comms["dp_cp_shard"])
    _reset_peak()
    start = _status_kb("VmRSS")
    state = initialized_state(
        config,
        layout,
        mesh,
        seed=0,
        compute_dtype=torch.bfloat16,
        device="cpu",
        moment_dtypes=(moments, moments),
    )
    init_mb = (_status_kb("VmHWM") - start) / 1024
    g = torch.Generator().manual_seed(mesh.coord("dp"))
    batches = []
    for _ in range(microbatches):
        t = torch.randint(0, sizes["vocab"], (1, sizes["seq"] + 1), generator=g)
        batches.append(
            {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(1, sizes["seq"])}
        )

    def step():
        return train_iteration(
            state,
            batches,
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(lr=1e-4, weight_decay=0.01, clip_grad=1.0),
        )

    step()
    _reset_peak()
    before = _status_kb("VmRSS")
    times = []
    for _ in range(steps):
        wire.log.clear()
        t0 = time.perf_counter()
        float(step()["grad_norm"])
        times.append(time.perf_counter() - t0)
    held = sum(
        b.numel() * b.element_size()
        for part in state.parts
        for b in [
            part.weights,
            part.grad,
            part.mu,
            part.nu,
            *(x for x in (part.main, part.grad32) if x is not None),
        ]
    )
    return {
        "ms": 1e3 * sorted(times)[len(times) // 2],
        "init_mb": init_mb,
        "peak_mb": (_status_kb("VmHWM") - before) / 1024,
        "rss_mb": _status_kb("VmHWM") / 1024,
        "state_mb": held / 2**20,
        "bytes_per_param": state.bytes_per_parameter(),
        "params": state.parts[0].flat.numel,
        "wire": wire.log,
    }


def main() -> None:
    from fmeg.parallel.spmd import GlooRanks

    a = parse_args()
    # freed tensors go back to the system at once (glibc's threshold would otherwise grow and keep
    # them), so the resident high-water mark follows what the step holds
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    sizes = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "vocab", "seq")}
    rows = {}
    for row, sharding, moments in STRATEGIES:
        pool = GlooRanks(4, timeout=1800)
        try:
            results = pool.run(
                rank_program, sharding, moments, sizes, a.microbatches, a.steps, tp=1
            )
        finally:
            pool.close()
        rows[row] = {k: max(r[k] for r in results) for k in results[0] if k != "wire"}
        rows[row]["wire"] = results[0]["wire"]
    n = rows["no_shard"]["params"]
    print(
        f"dp 4 on gloo, {n / 1e6:.0f}M parameters, bf16 + fp32 master, {a.microbatches} "
        f"microbatches of 1 x {a.seq} per rank, {os.cpu_count()} cores; median of {a.steps} steps; "
        "max over ranks"
    )
    print(
        f"the whole model in fp32: {4 * n / 2**20:.0f} MB (building it whole on each rank would "
        "add that to the init peak)"
    )
    print(
        f"{'strategy':>20} {'bytes/param':>12} {'state MB':>9} {'init peak MB':>13} "
        f"{'step peak MB':>13} {'RSS MB':>8} {'step ms':>8} {'state/no_shard':>15} "
        f"{'peak/no_shard':>14} {'time/no_shard':>14}"
    )
    base = rows["no_shard"]
    for sharding, r in rows.items():
        print(
            f"{sharding:>20} {r['bytes_per_param']:12.2f} {r['state_mb']:9.0f} "
            f"{r['init_mb']:13.0f} {r['peak_mb']:13.0f} {r['rss_mb']:8.0f} {r['ms']:8.0f} "
            f"{r['state_mb'] / base['state_mb']:15.2f} {r['rss_mb'] / base['rss_mb']:14.2f} "
            f"{r['ms'] / base['ms']:14.2f}"
        )
    print("rank 0's data-parallel collectives in a step: number x (logical MB)")
    for sharding, r in rows.items():
        count, volume = collections.Counter(), collections.Counter()
        for op, n in r["wire"]:
            count[op] += 1
            volume[op] += n / 2**20
        kinds = ", ".join(f"{op} {count[op]} ({volume[op]:.1f})" for op in count)
        print(f"{sharding:>20} {kinds}")


if __name__ == "__main__":
    main()
