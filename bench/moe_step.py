"""A mixture-of-experts training step against a dense step with the same active parameters, side by
side.

    python bench/moe_step.py                              # CPU shapes, fp32, eager
    # GPU shapes (Mixtral-like, 8 experts, top-2)
    python bench/moe_step.py --device cuda --dtype bf16
    python bench/moe_step.py --shape tiny --steps 1 --rounds 1   # a smoke run

Both run the runner's real step (fmeg.training.parallel_step.train_iteration on one rank's
FlatState). The dense model's FFN is topk x the expert FFN, so each token meets the same number of
MLP weights in both: the ratio dense / MoE of step times is what routing, sorting, grouped matmuls
and the load-balancing losses cost (1.0 would be free). Rounds alternate between the two; prints
median ms, tokens/s and the ratio, and which expert matmul path ran (torch._grouped_mm, or one
matmul per expert).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fmeg.models import gpt
from fmeg.ops import moe as moe_ops
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params, train_iteration
from fmeg.training.step_settings import StepSettings

SHAPES = {  # (hidden, layers, heads, expert ffn, experts, topk, batch, seq)
    "cpu": (256, 4, 8, 512, 8, 2, 4, 256),
    "cuda": (2048, 8, 16, 4096, 8, 2, 4, 2048),
    "tiny": (32, 2, 4, 64, 4, 2, 2, 16),  # a smoke run
}


def configs(shape: str) -> tuple[gpt.GPTConfig, gpt.GPTConfig, int, int]:
    h, layers, heads, ffn, experts, k, batch, seq = SHAPES[shape]
    common = dict(
        vocab_size=32000,
        max_seq_len=seq,
        num_layers=layers,
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=heads // 2,
    )
    moe = gpt.GPTConfig.llama(
        **common,
        ffn_hidden_size=ffn,
        num_experts=experts,
        moe_router_topk=k,
        moe_aux_loss_coeff=1e-2,
    )
    dense = gpt.GPTConfig.llama(**common, ffn_hidden_size=ffn * k)
    return moe, dense, batch, seq


def step_fn(config: gpt.GPTConfig, device: torch.device, dtype: torch.dtype):
    mesh, layout = Mesh.single(), Layout()
    params = shard_params(gpt.init(config, 0, device=device), config, layout, mesh)
    state = init_state(params, config, layout, mesh, compute_dtype=dtype)

    def step(batch: dict) -> torch.Tensor:
        return train_iteration(
            state,
            [batch],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(lr=1e-4, weight_decay=0.01, clip_grad=1.0),
        )["loss"]

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=list(SHAPES), default=None, help="default: the device's")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    moe, dense, batch, seq = configs(a.shape or a.device)
    tokens = torch.randint(
        0, moe.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    ).to(device)
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    steps = {"moe": step_fn(moe, device, dtype), "dense": step_fn(dense, device, dtype)}
    rows = torch.zeros(1, moe.hidden_size, device=device, dtype=dtype)
    weight = torch.zeros(
        moe.experts.num_experts, moe.ffn_hidden_size, moe.hidden_size, device=device, dtype=dtype
    )
    path = (
        "torch._grouped_mm"
        if moe_ops._grouped_mm_supported(rows, weight)
        else "one matmul per expert"
    )
    times: dict[str, list[float]] = {name: [] for name in steps}
    for name, step in steps.items():  # warm up
        float(step(data))
    for _ in range(a.rounds):
        for name, step in steps.items():
            for _ in range(a.steps):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                float(step(data))
                times[name].append(time.perf_counter() - start)
    print(
        f"device {device}, {a.dtype}; hidden {moe.hidden_size}, {moe.num_layers} layers, "
        f"{moe.experts.num_experts} experts top-{moe.experts.router.topk} of FFN "
        f"{moe.ffn_hidden_size} vs "
        f"dense FFN {dense.ffn_hidden_size}; batch {batch} x {seq}; experts run as {path}"
    )
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in median.items():
        print(f"{name:>6}: {t * 1e3:9.1f} ms/step  {batch * seq / t:10.0f} tokens/s")
    print(
        f"dense / moe step time: {median['dense'] / median['moe']:.2f}x (1.0: routing costs "
        "nothing)"
    )


if __name__ == "__main__":
    main()
