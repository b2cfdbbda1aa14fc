"""Each optimizer's step against AdamW's on one CPU rank, side by side in one run: the time of the
runner's optimizer step (norm, clip, update, refresh) and the persistent state per parameter.

    python bench/optimizers.py [--layers 4] [--hidden 256] [--steps 10]
"""

import argparse
import time

import torch

from fmeg.config.optimizer_flags import OptimizerConfig
from fmeg.models import gpt
from fmeg.optim import MuonSettings
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh
from fmeg.training.parallel_step import init_state, shard_params

CHOICES = {
    "adam": OptimizerConfig(),
    "sgd": OptimizerConfig(name="sgd"),
    "lion": OptimizerConfig(name="lion"),
    "muon (bf16)": OptimizerConfig(name="muon"),
    "muon (fp32)": OptimizerConfig(name="muon", muon=MuonSettings(bf16=False)),
    "adaptive_muon": OptimizerConfig(
        name="adaptive_muon", muon=MuonSettings(adaptive=(0.95, 1e-8))
    ),
    "soap": OptimizerConfig(name="soap"),
}


def step_seconds(choice: OptimizerConfig, config: gpt.GPTConfig, steps: int) -> tuple[float, float]:
    mesh, layout = Mesh.single(), Layout()
    params = shard_params(gpt.init(config, 0), config, layout, mesh)
    state = init_state(params, config, layout, mesh, optimizer=choice)
    state.grad.copy_(torch.randn_like(state.grad) * 1e-2)
    state.step(mesh, lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    start = time.perf_counter()
    for _ in range(steps):
        state.step(mesh, lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    return (time.perf_counter() - start) / steps, state.bytes_per_parameter()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    config = gpt.GPTConfig.gpt2(
        vocab_size=1024, max_seq_len=128, num_layers=a.layers, hidden_size=a.hidden, num_heads=4
    )
    print(f"{a.layers} layers, hidden {a.hidden}, {torch.get_num_threads()} threads, fp32 state")
    base, _ = step_seconds(CHOICES["adam"], config, a.steps)
    for name, choice in CHOICES.items():
        seconds, per_param = step_seconds(choice, config, a.steps)
        print(
            f"{name:14s} step {seconds * 1e3:8.2f} ms  x{seconds / base:6.2f} adam's  "
            f"state {per_param:5.2f} bytes per parameter"
        )


if __name__ == "__main__":
    main()
