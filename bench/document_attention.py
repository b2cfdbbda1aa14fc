"""Packed documents: attention by cu_seqlens against one causal attention over the whole packed row,
on CPU.

    python bench/document_attention.py [--seq 4096] [--mean-document 512] [--batch 2] [--heads 8]
        [--head-dim 64]

One forward-backward of the attention core (q [b, N, s, d], grouped keys N/2), median of 5 after a
warm-up, side by side in one run: causal attention over the whole row (what --reset-attention-mask
replaces; its work grows as s^2 / 2) and document attention (each document its own causal attention:
sum of length^2 / 2), eagerly and through the compiled op (torch.compile, aot_eager: the custom op's
fused blocks). With documents of mean length L the arithmetic falls by about s / L; the ratio
printed is the time of document attention over the causal one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fmeg import ops


def packing(b: int, s: int, mean: int, seed: int = 0) -> torch.Tensor:
    """cu_seqlens [b, s + 1] of documents with exponentially distributed lengths (mean `mean`)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        ends = np.minimum(np.cumsum(np.maximum(1, rng.exponential(mean, size=s)).astype(int)), s)
        ends = sorted(set(ends.tolist()) | {s})
        rows.append([0, *ends] + [s] * (s - len(ends)))
    return torch.tensor(rows)


def timed(fn, q, k, v, repeats: int = 5) -> float:
    def once():
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        return time.perf_counter() - start

    once()
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mean-document", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args()
    torch.manual_seed(0)
    b, n, s, d = a.batch, a.heads, a.seq, a.head_dim
    q = torch.randn(b, n, s, d, requires_grad=True)
    k, v = (torch.randn(b, n // 2, s, d, requires_grad=True) for _ in range(2))
    cu = packing(b, s, a.mean_document)
    documents = int((cu[:, 1:] > cu[:, :-1]).sum())
    compiled = torch.compile(
        lambda q, k, v, cu: ops.document_attention(q, k, v, cu), backend="aot_eager", fullgraph=True
    )
    rows = {
        "causal over the row": timed(ops.causal_attention, q, k, v),
        "documents, eager": timed(lambda q, k, v: ops.document_attention(q, k, v, cu), q, k, v),
        "documents, compiled op": timed(lambda q, k, v: compiled(q, k, v, cu), q, k, v),
    }
    print(
        f"b {b}, heads {n} (kv {n // 2}), seq {s}, head dim {d}: {documents} documents (mean "
        f"{b * s / documents:.0f} tokens); forward + backward, median of 5, "
        f"{torch.get_num_threads()} threads"
    )
    base = rows["causal over the row"]
    for name, t in rows.items():
        print(f"  {name:24s} {t * 1e3:8.1f} ms   {t / base:5.2f} x causal")


if __name__ == "__main__":
    main()
