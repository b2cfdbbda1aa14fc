"""How long inductor takes to compile a layer's dropout sites (fmeg.ops.dropout's counter hash,
forward and backward), with its default expansion and with the bound fmeg's stages compile under
(fmeg.models.gpt_pipeline._REALIZE_OPCOUNT), side by side in this run, the graph cache off.

    python bench/compile_dropout.py

Prints each setting's compile time, their ratio, whether the masks are the same and how far the
gradients are apart.
"""

from __future__ import annotations

import time

import torch
import torch._inductor.config as inductor_config

from fmeg import ops
from fmeg.models.gpt_pipeline import _REALIZE_OPCOUNT


def dropout_sites(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Attention's dropout on its probabilities and the hidden dropout after it, as in a layer."""
    probs = torch.softmax(x @ x.transpose(-1, -2), -1)
    y = x + ops.dropout(ops.dropout(probs, 0.1, key) @ x, 0.1, key + 1)
    return y.square().sum()


def compile_time(options: dict | None) -> tuple[float, torch.Tensor]:
    """(seconds to the first compiled forward and backward, the input's gradient)."""
    torch._dynamo.reset()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    compiled = torch.compile(dropout_sites, fullgraph=True, options=options)
    start = time.perf_counter()
    compiled(x, torch.tensor(7)).backward()
    return time.perf_counter() - start, x.grad


def main() -> None:
    inductor_config.fx_graph_cache = False
    # inductor's one-time start (imports, the C++ toolchain's probe) paid before either is timed
    torch.compile(lambda x: (x * 2).sum())(torch.ones(4))
    bounded, bounded_grad = compile_time({"realize_opcount_threshold": _REALIZE_OPCOUNT})
    default, default_grad = compile_time(None)
    same_masks = torch.equal(default_grad == 0, bounded_grad == 0)
    largest = ((default_grad - bounded_grad).abs().max() / default_grad.abs().max()).item()
    print(
        f"a layer's two dropout sites, compiled: inductor's default {default:.1f} s, bounded "
        f"({_REALIZE_OPCOUNT} ops) {bounded:.1f} s, {default / bounded:.1f}x faster; the same "
        f"masks: {same_masks}, gradients within {largest:.1e} of each other (fusion's rounding)"
    )


if __name__ == "__main__":
    main()
