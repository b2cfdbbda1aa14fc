"""Multi-latent attention against grouped-query attention at the same hidden size, on CPU.

    python bench/mla_step.py [--hidden 512] [--heads 8] [--seq 512] [--batch 2] [--layers 4]

One training step (forward and backward of the loss, torch.func.grad) of a 4-layer dense model,
median of 5 after a warm-up, side by side in one run: GQA (8 heads of 64 in 2 key/value groups) and
MLA shaped as DeepSeek-V3 shrunk to this width (a query latent of 3h/4 dims, a key/value latent of
h/2, per-head dims 64 + 32 rotated and values of 64, YaRN). Printed: each one's step time, its
parameters, its model FLOPs (Megatron's count) and the time ratio MLA / GQA; and the KV cache per
token and layer that generation keeps for each (fmeg caches MLA's expanded keys and values, as a
full-attention cache; the latent it could cache instead is given for comparison).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fmeg import tree
from fmeg.models import gpt
from fmeg.training.report import model_flops


def configs(hidden: int, heads: int, layers: int, seq: int) -> dict[str, gpt.GPTConfig]:
    base = gpt.GPTConfig.llama(
        vocab_size=1024,
        max_seq_len=seq,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=2,
        ffn_hidden_size=4 * hidden,
    )
    d = hidden // heads
    mla = base.replace(
        num_kv_heads=heads,
        qk_norm=True,
        multi_latent_attention=True,
        q_lora_rank=3 * hidden // 4,
        kv_lora_rank=hidden // 2,
        qk_head_dim=d,
        qk_pos_emb_head_dim=d // 2,
        v_head_dim=d,
        rope_type="yarn",
        rotary_scaling_factor=40.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    return {"gqa": base, "mla": mla}


def step_time(config: gpt.GPTConfig, batch: int, seq: int, repeats: int = 5) -> float:
    params = gpt.init(config, 0)
    tokens = torch.randint(
        0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    data = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    step = torch.func.grad(lambda p: gpt.loss(p, data, config))

    def once() -> float:
        start = time.perf_counter()
        step(params)
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def cache_values_per_token(c: gpt.GPTConfig) -> tuple[int, int]:
    """(values fmeg's cache keeps per token and layer, the latent's size)."""
    if c.attention.mla is not None:
        expanded = c.num_heads * (
            c.attention.mla.qk_head_dim
            + c.attention.mla.qk_pos_emb_head_dim
            + c.attention.mla.v_head_dim
        )
        return expanded, c.attention.mla.kv_lora_rank + c.attention.mla.qk_pos_emb_head_dim
    return 2 * c.num_kv_heads * c.head_dim, 2 * c.num_kv_heads * c.head_dim


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    torch.manual_seed(0)
    times = {}
    for name, c in configs(a.hidden, a.heads, a.layers, a.seq).items():
        times[name] = step_time(c, a.batch, a.seq)
        params = tree.num_params(gpt.init(c, 0))
        flops = model_flops(c, a.batch, a.seq)
        cached, latent = cache_values_per_token(c)
        print(
            f"{name}: step {times[name] * 1e3:.1f} ms, {params / 1e6:.2f}M parameters, "
            f"{flops / 1e9:.2f} GFLOP ({flops / times[name] / 1e9:.1f} GFLOP/s); KV cache {cached} "
            "values per token and "
            "layer" + (f" (the latent would be {latent})" if name == "mla" else "")
        )
    print(f"MLA / GQA step time: {times['mla'] / times['gqa']:.2f}")


if __name__ == "__main__":
    main()
