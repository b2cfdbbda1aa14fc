"""Bucketed data-parallel gradient reduction equals the per-leaf mean, with few collectives."""

import pytest
import torch

import spmd_programs as P
from fmeg import tree
from parallel_harness import run


@pytest.mark.parametrize("backend", ["threads", "gloo"])
@pytest.mark.parametrize("bucket_bytes, calls", [(1, 5), (10**9, 1), (1200, 2)])  # 392+24+800 | 80+800
def test_bucketed_mean_equals_per_leaf_mean(backend, bucket_bytes, calls):
    gen = torch.Generator().manual_seed(0)
    shapes = [(10, 10), (10,), (20, 5), (3,), (7, 7)]
    per_rank = [{"layers": [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]} for _ in range(2)]
    want = tree.tree_map(lambda a, b: (a + b) / 2, *per_rank)
    for got, n in run(backend, 2, P.bucketed_mean, per_rank, bucket_bytes, tp=1):
        assert n == calls
        for g, w in zip(tree.tree_leaves(got), tree.tree_leaves(want)):
            torch.testing.assert_close(g, w)
