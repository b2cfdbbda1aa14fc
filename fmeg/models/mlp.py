"""The dense MLP, fc2(activation(fc1(x))), that a GPT layer and a mixture's shared expert both run.

Parameters: fc1 {"weight": [F, H] or [2, F, H] (gate, linear), "bias"?}, fc2 {"weight": [H, F],
"bias"?}. Sharding contract: fc1 is column-parallel and fc2 row-parallel (Megatron's ParallelMLP): a
tensor-parallel rank holds F / tp of the hidden units, its input is the whole (or, under sequence
parallelism, gathered) x, and its output is the sum over tp (reduce-scattered under sequence
parallelism).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fmeg.parallel.tensor import NO_TP, TensorParallel, column_parallel_linear, row_parallel_linear


def dense_mlp(
    p: dict[str, Any], x_BSH: torch.Tensor, activation: Callable, tp: TensorParallel = NO_TP
) -> torch.Tensor:
    """fc2(activation(fc1(x))), column- then row-parallel."""
    h = column_parallel_linear(x_BSH, p["fc1"]["weight"], p["fc1"].get("bias"), tp, site="fc1")
    fc2 = p["fc2"]
    return row_parallel_linear(activation(h), fc2["weight"], fc2.get("bias"), tp, site="fc2")
