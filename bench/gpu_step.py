"""The runner's training step against a compiled nanoGPT-style step, side by side in one process.

    # GPT-2 124M, 1.3B and a Llama-style 1B on the GPU
    python bench/gpu_step.py
    python bench/gpu_step.py --model 1.3b --steps 20
    # a smoke run anywhere
    python bench/gpu_step.py --model tiny --device cpu --steps 2 --no-compile
    # also: one profiled step of each, kernels by time
    python bench/gpu_step.py --model 1.3b --profile
    # the host-time proxy, compiled, on a CPU
    python bench/gpu_step.py --model host --device cpu --steps 30
    # also: the same step with sharded weights
    python bench/gpu_step.py --sharding optim_grads_params
    # also: multi-latent attention against GQA at this width
    python bench/gpu_step.py --model llama-1b --mla
    # also: the runner's step under Muon (Newton-Schulz in bf16, Adam on the rest)
    python bench/gpu_step.py --muon

fmeg: the runner's real step (fmeg.training.parallel_step.train_iteration on a FlatState: bf16
compute, fp32 master weights and gradients, global-norm clipping at 1.0, fused AdamW), one rank,
each layer compiled as the runner compiles it on CUDA. The peer: a GPT written here as a plain
nn.Module in nanoGPT's style (fp32 parameters under bf16 autocast, SDPA attention, torch.optim.AdamW
fused on CUDA, clip_grad_norm_), the whole model compiled. --no-compile runs both eagerly. Both run
the same shapes and the same FLOPs (Megatron's count, fmeg.training.report.model_flops); rounds
alternate between the two. Prints median ms, TFLOP/s, MFU against the device's dense bf16 peak, peak
memory, and the throughput ratio fmeg / peer (above 1.0: fmeg is faster).

--sharding adds a third variant: the runner's step with that data-parallel sharding (Megatron-FSDP's
strategy) on one rank, so each layer is still gathered into its buffer before its forward and its
backward, its storage released after, and its gradients reduced into the owned slice per microbatch.
With one GPU there is no peer to gather from: this row prices the mechanism (copies, storage
resizes, per-unit bookkeeping), and the ratio sharded / runner shows what it costs. Whether the
gathers overlap compute needs several GPUs on NCCL; the CPU figures at dp 4 are bench/fsdp_cpu.py's.

--muon adds the runner's step with --optimizer muon's defaults (each matrix orthogonalized whole
by five quintic Newton-Schulz iterations in bf16, Adam on the embeddings, norms and biases) and
its ratio to the AdamW step.

--fp8 RECIPE adds the runner's step with that FP8 recipe (hybrid: e4m3 forward, e5m2 gradients)
in every layer's qkv, projection and MLP GEMMs, and its ratio to the bf16 step.

--mla adds, for each model, the runner's step of a GQA model and of an MLA model at its width
(bench/mla_step.py's shapes: DeepSeek-V3's MLA shrunk to the width, q latent 3h/4, kv latent h/2,
YaRN; the model's depth, sequence, batch and vocabulary), side by side, and their ratio: the GPU
figure of bench/mla_step.py's CPU one.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from fmeg.config.optimizer_flags import OptimizerConfig
from fmeg.fp8.delayed import DelayedState
from fmeg.fp8.plan import Fp8Plan
from fmeg.fp8.recipe import Fp8Recipe
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import initialized_state, train_iteration
from fmeg.training.step_settings import StepSettings
from fmeg.training.report import model_flops

MODELS = {  # (config, batch)
    "gpt2-124m": (
        gpt.GPTConfig.gpt2(vocab_size=50257, padded_vocab_size=50304, max_seq_len=1024),
        16,
    ),
    "1.3b": (
        gpt.GPTConfig.gpt2(
            vocab_size=50257,
            padded_vocab_size=50304,
            max_seq_len=2048,
            num_layers=24,
            hidden_size=2048,
            num_heads=16,
        ),
        4,
    ),
    "llama-1b": (
        gpt.GPTConfig.llama(
            vocab_size=32000,
            max_seq_len=2048,
            num_layers=16,
            hidden_size=2048,
            num_heads=16,
            num_kv_heads=4,
            ffn_hidden_size=5632,
        ),
        4,
    ),
    # a host-time proxy: 12 layers with next to no arithmetic, so a CPU step times the Python that
    # launches it
    "host": (
        gpt.GPTConfig.gpt2(
            vocab_size=500,
            padded_vocab_size=512,
            max_seq_len=16,
            num_layers=12,
            hidden_size=32,
            num_heads=2,
        ),
        1,
    ),
    "tiny": (
        gpt.GPTConfig.llama(
            vocab_size=500,
            padded_vocab_size=512,
            max_seq_len=64,
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
        ),
        2,
    ),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


class PeerGPT(nn.Module):
    """nanoGPT's shape of model for the same GPTConfig: pre-norm blocks, fused qkv, SDPA
    attention."""

    def __init__(self, c: gpt.GPTConfig):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.padded_vocab_size, c.hidden_size)
        self.wpe = nn.Embedding(c.max_seq_len, c.hidden_size) if c.position == "learned" else None
        norm = (
            (lambda: nn.RMSNorm(c.hidden_size, eps=c.norm_eps))
            if c.norm == "rmsnorm"
            else (lambda: nn.LayerNorm(c.hidden_size, eps=c.norm_eps, bias=c.bias))
        )
        kv = c.num_kv_heads * c.head_dim
        ffn_out = 2 * c.ffn_hidden_size if c.activation == "swiglu" else c.ffn_hidden_size
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": norm(),
                    "qkv": nn.Linear(c.hidden_size, c.hidden_size + 2 * kv, bias=c.bias),
                    "proj": nn.Linear(c.hidden_size, c.hidden_size, bias=c.bias),
                    "ln2": norm(),
                    "fc1": nn.Linear(c.hidden_size, ffn_out, bias=c.bias),
                    "fc2": nn.Linear(c.ffn_hidden_size, c.hidden_size, bias=c.bias),
                }
            )
            for _ in range(c.num_layers)
        )
        self.ln_f = norm()
        self.head = (
            None if c.tie_embeddings else nn.Linear(c.hidden_size, c.padded_vocab_size, bias=False)
        )
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=c.init_std)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        s, d = x.shape[-2], x.shape[-1]
        inv = 1.0 / (self.c.rope.theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
        angles = torch.outer(torch.arange(s, device=x.device).float(), inv)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        c, (b, s) = self.c, tokens.shape
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(s, device=tokens.device))
        kv = c.num_kv_heads * c.head_dim
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split([c.hidden_size, kv, kv], dim=-1)
            q, k, v = (t.view(b, s, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))
            if c.position == "rope":
                q, k = self.rope(q), self.rope(k)
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=c.num_kv_heads != c.num_heads
            )
            x = x + blk["proj"](y.transpose(1, 2).reshape(b, s, c.hidden_size))
            h = blk["fc1"](blk["ln2"](x))
            if c.activation == "swiglu":
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h, approximate="tanh" if c.activation == "gelu_tanh" else "none")
            x = x + blk["fc2"](h)
        x = self.ln_f(x)
        logits = self.head(x) if self.head is not None else F.linear(x, self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def peer_step(config: gpt.GPTConfig, device: torch.device, compile_: bool):
    model = PeerGPT(config).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused, foreach=not fused
    )
    forward = torch.compile(model) if compile_ else model

    def step(batch: dict) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(batch["tokens"], batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fmeg_step(
    config: gpt.GPTConfig,
    device: torch.device,
    compile_: bool,
    sharding: str = "no_shard",
    optimizer: OptimizerConfig = OptimizerConfig(),
    fp8: str | None = None,
):
    mesh, layout = Mesh.single(), Layout(sharding=sharding)
    # delayed scaling's amax history and scales, as the runner keeps them
    delayed = DelayedState(config.num_layers, 1, device) if fp8 == "delayed" else None
    plan = Fp8Plan(Fp8Recipe("hybrid", fp8), config.num_layers, state=delayed) if fp8 else None
    state = initialized_state(
        config,
        layout,
        mesh,
        seed=0,
        compute_dtype=torch.bfloat16,
        device=device,
        optimizer=optimizer,
    )

    def step(batch: dict) -> torch.Tensor:
        return train_iteration(
            state,
            [batch],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(
                lr=1e-4,
                weight_decay=0.01,
                clip_grad=1.0,
                compile="inductor" if compile_ else None,
                # as the runner: a non-finite step is skipped
                check_overflow=True,
                fp8=plan,
            ),
        )["loss"]

    return step


GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "cublas")
# not "bf16_s16816gemm": bf16 inputs, fp32 accumulation
FP32_GEMM_MARKS = ("f32f32", "sgemm", "tf32", "fp32")


def profile_one_step(variant: str, step, batch: dict, top: int = 12) -> None:
    """One step under torch.profiler: device kernels counted and timed, GEMMs apart, fp32 GEMMs
    named."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True
    ) as prof:
        t0 = time.perf_counter()
        step(batch)
        launched = time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    total = sum(sum(v) for v in kernels.values())
    gemm = {k: v for k, v in kernels.items() if any(m in k.lower() for m in GEMM_MARKS)}
    fp32 = {k: v for k, v in gemm.items() if any(m in k.lower() for m in FP32_GEMM_MARKS)}
    print(
        f"\nprofile, {variant}: wall {wall * 1e3:.1f} ms (host returned after {launched * 1e3:.1f} "
        f"ms), {sum(map(len, kernels.values()))} kernels, {total:.1f} ms of device time; GEMMs "
        f"{sum(map(sum, gemm.values())):.1f} ms; fp32 GEMMs {sum(map(sum, fp32.values())):.1f} ms "
        f"in {sum(map(len, fp32.values()))} launches"
    )
    launcher = _launching_ops(prof.events())
    for name, ts in fp32.items():
        print(
            f"  fp32 GEMM {sum(ts):8.2f} ms x{len(ts):<4} {name[:110]}  <- "
            f"{launcher.get(name, '?')}"
        )
    for name, ts in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(ts):8.2f} ms x{len(ts):<5} {name[:100]}  <- {launcher.get(name, '?')[:120]}")


def _launching_ops(events) -> dict[str, str]:
    """{kernel name: the aten op (with input shapes) that launched its first instance}."""
    out: dict[str, str] = {}
    for e in events:
        for k in getattr(e, "kernels", ()):
            if k.name in out:
                continue
            op = e
            while op is not None and not op.name.startswith("aten::"):
                op = op.cpu_parent
            out[k.name] = f"{op.name} {op.input_shapes}" if op is not None else e.name
    return out


def host_profile(step, batch: dict, top: int = 25) -> None:
    """cProfile of one step's host side (what the Python launching the kernels spends its time
    on)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    step(batch)
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def peak_for(device: torch.device, override: float | None) -> float | None:
    if override or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def bench(
    name: str,
    device: torch.device,
    steps: int,
    warmup: int,
    compile_: bool,
    peak: float | None,
    profile_: bool = False,
    sharding: str | None = None,
    muon: bool = False,
    fp8: str | None = None,
) -> dict:
    config, batch_size = MODELS[name]
    # Each model compiles afresh, as in its own process: after a first model, dynamo would otherwise
    # recompile the shared layer function with dynamic shapes, whose kernels are slower.
    torch._dynamo.reset()
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, config.max_seq_len + 1), device=device
    )
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    variants = {
        "fmeg runner": fmeg_step(config, device, compile_),
        "nanoGPT-style peer": peer_step(config, device, compile_),
    }
    if sharding:
        variants[f"fmeg {sharding}"] = fmeg_step(config, device, compile_, sharding)
    if muon:
        muon_choice = OptimizerConfig(name="muon")
        variants["fmeg muon"] = fmeg_step(config, device, compile_, optimizer=muon_choice)
    if fp8:
        variants[f"fmeg fp8 {fp8}"] = fmeg_step(config, device, compile_, fp8=fp8)
    times: dict[str, list[float]] = {k: [] for k in variants}
    memory: dict[str, float] = {}
    for i in range(warmup + steps):
        for variant, step in variants.items():  # alternate: both see the same machine state
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            loss = float(step(batch))
            elapsed = time.perf_counter() - t0
            assert math.isfinite(loss), f"{variant}: loss {loss}"
            if i >= warmup:
                times[variant].append(elapsed)
            if device.type == "cuda":
                memory[variant] = torch.cuda.max_memory_allocated(device) / 2**30
    flops = model_flops(config, batch_size, config.max_seq_len)
    print(
        f"\n{name}: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} "
        f"heads ({config.num_kv_heads} kv), seq {config.max_seq_len}, batch {batch_size}, vocab "
        f"{config.padded_vocab_size}, {flops / 1e12:.2f} TFLOP per step; both "
        f"{'compiled' if compile_ else 'eager'}"
    )
    print(f"{'variant':<25} {'median ms':>10} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>9}")
    medians = {}
    for variant, ts in times.items():
        medians[variant] = statistics.median(ts)
        tflops = flops / medians[variant] / 1e12
        mfu = f"{tflops / peak:.1%}" if peak else "n/a"
        mem = f"{memory[variant]:.1f}" if variant in memory else "n/a"
        print(f"{variant:<25} {medians[variant] * 1e3:>10.1f} {tflops:>9.2f} {mfu:>7} {mem:>9}")
    ratio = medians["nanoGPT-style peer"] / medians["fmeg runner"]
    print(f"throughput ratio fmeg / peer: {ratio:.2f}")
    if sharding:
        print(
            f"step time {sharding} / runner: "
            f"{medians[f'fmeg {sharding}'] / medians['fmeg runner']:.2f}"
        )
    if muon:
        print(f"step time muon / adamw: {medians['fmeg muon'] / medians['fmeg runner']:.2f}")
    if fp8:
        print(f"step time fp8 / bf16: {medians[f'fmeg fp8 {fp8}'] / medians['fmeg runner']:.2f}")
    if profile_ and device.type == "cuda":
        try:
            for variant, step in variants.items():
                profile_one_step(variant, step, batch)
            host_profile(variants["fmeg runner"], batch)
        except Exception as e:  # a profile that fails still leaves the figures above
            print(f"profile failed: {type(e).__name__}: {e}")
    return {"model": name, "ratio": ratio, **{f"{k} ms": v * 1e3 for k, v in medians.items()}}


def bench_mla(
    name: str, device: torch.device, steps: int, warmup: int, compile_: bool, peak: float | None
) -> dict:
    """The runner's step with GQA and with MLA at the model's width (bench/mla_step.py's shapes),
    alternating."""
    from mla_step import configs

    model, batch_size = MODELS[name]
    pair = {
        k: c.replace(vocab_size=model.vocab_size, padded_vocab_size=model.padded_vocab_size)
        for k, c in configs(
            model.hidden_size, model.num_heads, model.num_layers, model.max_seq_len
        ).items()
    }
    torch._dynamo.reset()
    tokens = torch.randint(0, model.vocab_size, (batch_size, model.max_seq_len + 1), device=device)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    steps_of = {k: fmeg_step(c, device, compile_) for k, c in pair.items()}
    times: dict[str, list[float]] = {k: [] for k in pair}
    for i in range(warmup + steps):
        for variant, step in steps_of.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = float(step(batch))
            assert math.isfinite(loss), f"{variant}: loss {loss}"
            if i >= warmup:
                times[variant].append(time.perf_counter() - t0)
    print(
        f"\n{name} width, attention: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_heads} heads, seq {model.max_seq_len}, batch {batch_size}"
    )
    print(f"{'variant':<25} {'median ms':>10} {'TFLOP/s':>9} {'MFU':>7}")
    medians = {}
    for variant, ts in times.items():
        medians[variant] = statistics.median(ts)
        tflops = model_flops(pair[variant], batch_size, model.max_seq_len) / medians[variant] / 1e12
        print(
            f"{'fmeg ' + variant:<25} {medians[variant] * 1e3:>10.1f} {tflops:>9.2f} "
            f"{f'{tflops / peak:.1%}' if peak else 'n/a':>7}"
        )
    ratio = medians["mla"] / medians["gqa"]
    print(f"step time MLA / GQA: {ratio:.2f}")
    return {"model": f"{name} mla", "mla / gqa": ratio}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        choices=list(MODELS),
        action="append",
        help="repeatable; default: gpt2-124m, 1.3b and llama-1b",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--no-compile", action="store_true", help="run both eagerly")
    p.add_argument(
        "--profile", action="store_true", help="then profile one step of each (CUDA only)"
    )
    p.add_argument(
        "--sharding",
        choices=["optim", "optim_grads", "optim_grads_params"],
        help="also time the runner's step with this data-parallel sharding (one rank)",
    )
    p.add_argument(
        "--mla", action="store_true", help="also time MLA against GQA at each model's width"
    )
    p.add_argument("--muon", action="store_true", help="also time the runner's step under Muon")
    p.add_argument(
        "--fp8",
        choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
        help="also time the runner's step with this FP8 recipe (hybrid) in every layer",
    )
    a = p.parse_args(argv)
    device = torch.device(a.device)
    peak = peak_for(device, a.peak_tflops)
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"device {device}{name}, torch {torch.__version__}, dense bf16 peak {peak} TFLOP/s")
    models = a.model or ["gpt2-124m", "1.3b", "llama-1b"]
    rows = [
        bench(
            m,
            device,
            a.steps,
            a.warmup,
            not a.no_compile,
            peak,
            a.profile,
            a.sharding,
            a.muon,
            a.fp8,
        )
        for m in models
    ]
    return rows + [
        bench_mla(m, device, a.steps, a.warmup, not a.no_compile, peak) for m in models if a.mla
    ]


if __name__ == "__main__":
    main()
