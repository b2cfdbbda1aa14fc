"""Model FLOP utilisation of one training step on one device.

    python bench/mfu.py --model 1.3b              # 24 layers, hidden 2048, seq 2048, bf16 (on a GPU)
    python bench/mfu.py --model gpt2-124m
    python bench/mfu.py --model tiny --device cpu --steps 3      # a smoke run anywhere

Times fmeg's training step (forward, backward, clipping, AdamW; bf16 parameters) eagerly and under
torch.compile, and prints achieved TFLOP/s (Megatron's 72 B s L h^2 (1 + s/6h + V/12Lh) per step) and MFU
against the device's dense bf16 peak (--peak-tflops, or a known GPU's figure).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from fmeg import optim
from fmeg.models import gpt
from fmeg.train_step import compile_train_step, make_train_step
from fmeg.training.report import model_flops

MODELS = {
    "1.3b": dict(num_layers=24, hidden_size=2048, num_heads=16, seq=2048, batch=4, vocab_size=50304),
    "gpt2-124m": dict(num_layers=12, hidden_size=768, num_heads=12, seq=1024, batch=16, vocab_size=50304),
    "tiny": dict(num_layers=2, hidden_size=128, num_heads=4, seq=128, batch=4, vocab_size=512),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


def peak_for(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS), default="1.3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    spec = dict(MODELS[a.model])
    seq, batch = spec.pop("seq"), a.batch or spec.pop("batch")
    spec.pop("batch", None)
    device = torch.device(a.device)
    config = gpt.GPTConfig.gpt2(max_seq_len=seq, **spec)
    params = gpt.init(config, 0, dtype=torch.bfloat16, device=device)
    opt = optim.adamw()
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    lr, wd = torch.tensor(1e-4, device=device), torch.tensor(0.01, device=device)
    flops = model_flops(config, batch, seq)
    peak = peak_for(device, a.peak_tflops)
    step = make_train_step(partial(gpt.loss, config=config), opt, clip_grad=1.0)
    variants = {"eager": step} if a.no_compile else {"eager": step, "compiled": compile_train_step(step)}
    print(f"{a.model}: {config.num_layers} layers, hidden {config.hidden_size}, seq {seq}, batch {batch}, bf16, "
          f"{flops / 1e12:.1f} TFLOP per step, device {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, peak {peak} TFLOP/s")
    print(f"{'variant':<10} {'median ms':>10} {'TFLOP/s':>9} {'MFU':>7}")
    for name, fn in variants.items():
        state = {"p": params, "o": opt.init(params)}
        times = []
        for i in range(a.warmup + a.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            state["p"], state["o"], m = fn(state["p"], state["o"], data, lr, wd)
            float(m["loss"])
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        tflops = flops / med / 1e12
        mfu = f"{tflops / peak:.1%}" if peak else "n/a"
        print(f"{name:<10} {med * 1e3:>10.1f} {tflops:>9.1f} {mfu:>7}")


if __name__ == "__main__":
    main()
