"""How long inductor takes to compile one dropout site (fmeg.ops.dropout's counter hash, forward
and backward), with its default expansion and with the bound fmeg's stages compile under
(fmeg.models.gpt_pipeline._REALIZE_OPCOUNT), side by side in this run, the graph cache off.

    python bench/compile_dropout.py

Prints each setting's compile time, their ratio, and whether the two compiled masks are the same.
"""

from __future__ import annotations

import time

import torch
import torch._inductor.config as inductor_config

from fmeg import ops
from fmeg.models.gpt_pipeline import _REALIZE_OPCOUNT


def dropout_site(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return ops.dropout(x, 0.1, key).square().sum()


def compile_time(options: dict | None) -> tuple[float, torch.Tensor]:
    """(seconds to the first compiled forward and backward, the input's gradient)."""
    torch._dynamo.reset()
    x = torch.randn(2, 16, 32, requires_grad=True)
    compiled = torch.compile(dropout_site, fullgraph=True, options=options)
    start = time.perf_counter()
    compiled(x, torch.tensor(7)).backward()
    return time.perf_counter() - start, x.grad


def main() -> None:
    inductor_config.fx_graph_cache = False
    bounded, bounded_grad = compile_time({"realize_opcount_threshold": _REALIZE_OPCOUNT})
    default, default_grad = compile_time(None)
    print(
        f"one dropout site, compiled: inductor's default {default:.1f} s, bounded "
        f"({_REALIZE_OPCOUNT} ops) {bounded:.1f} s, {default / bounded:.1f}x faster; "
        f"same gradient: {torch.equal(default_grad, bounded_grad)}"
    )


if __name__ == "__main__":
    main()
