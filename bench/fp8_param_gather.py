"""--fp8-param-gather against the compute dtype's gather: the distributed optimizer's all-gather of
the weights after a step, on 2 data-parallel ranks that are threads, for a GPT-2 124M-shaped and a
Llama-shaped model in bf16, side by side: the bytes each rank receives and the refresh's time
(pack, all-gather, unpack; a CPU proxy: on a GPU the bytes are what the interconnect carries).

    python bench/fp8_param_gather.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from fmeg.fp8.param_gather import Fp8ParamGather
from fmeg.fp8.plan import Fp8Plan
from fmeg.fp8.recipe import Fp8Recipe
from fmeg.models import gpt
from fmeg.parallel.layout import Layout
from fmeg.parallel.spmd import run_threads
from fmeg.testing.curves import mesh_sizes
from fmeg.training.fp8_state import fp8_weight_pieces
from fmeg.training.parallel_step import initialized_state

MODELS = {
    "gpt2 124M": gpt.GPTConfig.gpt2(num_layers=12, hidden_size=768, num_heads=12),
    "llama 12 x 1024": gpt.GPTConfig.llama(
        vocab_size=32000, padded_vocab_size=32000, num_layers=12, hidden_size=1024,
        num_heads=16, num_kv_heads=4, ffn_hidden_size=4096, max_seq_len=1024,
    ),
}  # fmt: skip
LAYOUT = Layout(dp=2, micro_batch_size=1, sharding="optim")


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_rank(mesh, config, repeat: int) -> dict:
    state = initialized_state(
        config, LAYOUT, mesh, seed=0, compute_dtype=torch.bfloat16, device="cpu"
    )
    plan = Fp8Plan(Fp8Recipe("hybrid", "tensorwise"), config.num_layers, param_gather=True)
    cfg = SimpleNamespace(model=config, layout=LAYOUT)
    group = mesh.group("dp_cp_shard")
    gather = Fp8ParamGather(
        fp8_weight_pieces(state, cfg, plan, None, 0),
        state.flat.units,
        state.flat.chunk_starts,
        state.dp,
        state.dp_rank,
        state.weights.dtype,
        plan.recipe,
        (group,),
    )
    plain = timed(lambda: state.refresh(group), repeat)
    state.fp8_gather = gather
    fp8 = timed(lambda: state.refresh(group), repeat)
    return {"bytes": gather.unpacked, "fp8_bytes": gather.sent, "s": plain, "fp8_s": fp8}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    out = {}
    for name, config in MODELS.items():
        r = run_threads(2, one_rank, config, a.repeat, timeout=600.0, **mesh_sizes(LAYOUT))[0]
        out[name] = r
        print(
            f"{name}: gathered {r['bytes'] / 2**20:.1f} MiB in bf16, {r['fp8_bytes'] / 2**20:.1f} "
            f"MiB with FP8 weights ({r['fp8_bytes'] / r['bytes']:.2f}x); refresh {r['s'] * 1e3:.0f}"
            f" ms, {r['fp8_s'] * 1e3:.0f} ms ({r['fp8_s'] / r['s']:.2f}x)"
        )
    return out


if __name__ == "__main__":
    main()
