"""Context parallelism on CPU: activation memory per rank against cp, and step time at cp 2 against
cp 1.

    python bench/context_parallel.py [--seqs 8192 32768] [--cps 1 2 4] [--comm-type p2p] [--time-seq
        4096]

Memory: the bytes one rank's forward keeps for its backward (saved-tensor hooks, each storage
counted once), the activation memory Korthikanti et al. count, for a tiny GPT (2 layers, hidden 64,
4 heads, batch 1) on gloo ranks; the ratio to cp 1 should be close to 1 / cp. Time: one
forward-backward of the same sequence at cp 1 (one process) and cp 2 (two processes), one thread per
rank, median of 3 after a warm-up, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fmeg.models import gpt
from fmeg.parallel.context import ContextParallel, shard_sequence
from fmeg.parallel.spmd import GlooRanks
from fmeg.parallel.tensor import TensorParallel
from fmeg.training.report import memory_estimate


def model(seq: int) -> gpt.GPTConfig:
    return gpt.GPTConfig.llama(
        vocab_size=256,
        max_seq_len=seq,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=256,
    )


def batch(seq: int) -> dict:
    tokens = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def rank_program(mesh, seq: int, comm_type: str, mode: str):
    config = model(seq)
    cp = ContextParallel(mesh.group("cp"), comm_type)
    tp = TensorParallel(context=cp)
    params = gpt.init(config, 0)
    mine = {k: shard_sequence(t, cp) for k, t in batch(seq).items()}
    if mode == "memory":
        seen: dict[int, int] = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return t

        leaves = {
            p.requires_grad_().untyped_storage().data_ptr()
            for p in torch.utils._pytree.tree_leaves(params)
        }
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            gpt.loss(params, mine, config, tp=tp)
        # activations, not the weights
        return sum(n for ptr, n in seen.items() if ptr not in leaves)
    step = lambda: torch.func.grad(lambda p: gpt.loss(p, mine, config, tp=tp))(params)  # noqa: E731
    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--comm-type", default="p2p", choices=["p2p", "all_gather", "a2a"])
    ap.add_argument("--time-seq", type=int, default=4096)
    a = ap.parse_args()
    pools = {n: GlooRanks(n, timeout=1200) for n in sorted(set(a.cps) | {1, 2})}
    try:
        print(
            f"activation memory per rank (MB), comm type {a.comm_type}: what one rank's forward "
            "keeps for backward"
        )
        for seq in a.seqs:
            base = None
            for cp in a.cps:
                mb = pools[cp].run(rank_program, seq, a.comm_type, "memory", cp=cp)[0] / 2**20
                base = base or mb
                # the start line's estimate of the same (fmeg.training.report), fp32, one microbatch
                said = (
                    memory_estimate(0, 0, model(seq), 1, seq, 1, 1, 1, cp=cp)["activations"] / 2**20
                )
                print(
                    f"  seq {seq:6d}  cp {cp}: {mb:9.1f} MB   x{mb / base:.3f} of cp 1 (1/cp = "
                    f"{1 / cp:.3f})   start line's estimate {said:.1f} MB ({said / mb:.2f}x)"
                )
        one = pools[1].run(rank_program, a.time_seq, a.comm_type, "time", cp=1)[0]
        two = max(pools[2].run(rank_program, a.time_seq, a.comm_type, "time", cp=2))
        print(
            f"step time at seq {a.time_seq} (forward-backward, one thread per rank): cp 1 "
            f"{one * 1e3:.0f} ms, cp 2 {two * 1e3:.0f} ms; cp 1 / cp 2 = {one / two:.2f}x"
        )
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
