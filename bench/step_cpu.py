"""One CPU training step (forward, backward, clip, AdamW): fmeg eager and compiled vs transformers
eager. fmeg's step is the runner's (parallel_step.train_iteration on one rank), its layers compiled
or not.

    # GPT-2 shape: 6 layers, hidden 384, 6 heads, seq 256, batch 8
    python bench/step_cpu.py
    python bench/step_cpu.py --steps 5 --layers 2    # a quicker look

All variants train the same weights on the same batch in one process; rounds alternate between them
so drift in the machine's speed touches each alike. Prints median step times and ratios to
transformers, and the fp32 matmul floor: the step's model FLOPs (Megatron's formula) at this
machine's peak sgemm rate, measured in the same run. No fp32 implementation of the same math can
step faster than that.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per variant (compilation happens here)"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the compiled fmeg variant")
    return p.parse_args()


def hf_step_fn(model, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(batch["tokens"]).logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return step


def fmeg_step_fn(params, config, batch, compiled: bool):
    from fmeg.parallel.mesh import Mesh
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings

    mesh, layout = Mesh.single(), Layout()
    state = init_state(shard_params(params, config, layout, mesh), config, layout, mesh)

    def run():
        return train_iteration(
            state,
            [batch],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(
                lr=1e-4, weight_decay=0.01, clip_grad=1.0, compile="inductor" if compiled else None
            ),
        )["loss"]

    return run


def model_flops(layers: int, hidden: int, seq: int, batch: int, vocab: int) -> float:
    """Megatron's FLOPs per iteration for a dense GPT with a 4h GELU MLP (forward and backward)."""
    return (
        72
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    )


def peak_sgemm_flops(n: int = 2048, repeats: int = 5) -> float:
    """The best fp32 matmul rate seen on square n x n matrices (FLOP/s)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    from fmeg.interop.hf import from_hf

    torch.manual_seed(0)
    hf_config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.hidden,
        n_head=args.heads,
        vocab_size=args.vocab,
        n_positions=args.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(hf_config).float().train()
    config, params = from_hf(model)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}

    variants = {
        "transformers eager": hf_step_fn(model, batch),
        "fmeg eager": fmeg_step_fn(params, config, batch, compiled=False),
    }
    if not args.no_compile:
        variants["fmeg compiled"] = fmeg_step_fn(params, config, batch, compiled=True)

    first_loss = {}
    for name, fn in variants.items():
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            first_loss.setdefault(name, float(fn()))
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    base = statistics.median(times["transformers eager"])
    flops, peak = (
        model_flops(args.layers, args.hidden, args.seq, args.batch, args.vocab),
        peak_sgemm_flops(),
    )
    print(
        f"\nGPT-2 shape: layers={args.layers} hidden={args.hidden} heads={args.heads} "
        f"seq={args.seq} batch={args.batch} vocab={args.vocab} fp32, "
        f"threads={torch.get_num_threads()}, torch {torch.__version__}"
    )
    print(f"{'variant':<20} {'median ms':>10} {'ratio to transformers':>22} {'first loss':>11}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<20} {med * 1e3:>10.1f} {med / base:>22.3f} {first_loss[name]:>11.4f}")
    floor = flops / peak
    print(
        f"{'fp32 matmul floor':<20} {floor * 1e3:>10.1f} {floor / base:>22.3f}   "
        f"({flops / 1e9:.0f} GFLOP per step at a peak sgemm of {peak / 1e9:.0f} GFLOP/s)"
    )


if __name__ == "__main__":
    main()
