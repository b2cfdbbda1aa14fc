"""Attention over one block of keys, with its log-sum-exp, and that block's share of the backward
pass.

Context parallelism cuts a causal attention into blocks (a chunk of queries against a chunk of keys)
and merges the blocks' results by their log-sum-exp, FlashAttention's online softmax:

    out, lse = block_forward(q, k, v, causal)          each block alone
    out, lse = merge(out, lse, out_b, lse_b)            rows that saw several blocks
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal)

block_backward takes the *merged* out and lse of the whole row, so each block's probabilities are
the row's global ones and the blocks' gradients add up to the gradient of the whole attention (no
gradient through lse is needed). Shapes: q [b, N, sq, d]; k, v [b, G, sk, d] (G divides N,
grouped-query attention); out [b, N, sq, d]; lse [b, N, sq] in fp32 (fp64 for fp64 inputs). causal:
the block lies on the diagonal (sq == sk, query i sees keys 0..i); otherwise every query sees every
key.

A block runs through a fused kernel behind scaled_dot_product_attention that returns the log-sum-exp
and whose backward takes one: the flash kernel on CPU, the memory-efficient one on CUDA (fp32, fp16
and bf16, head dims a multiple of 8; its lse comes padded to a multiple of 32 rows, and goes back to
its backward padded). With attention dropout, for other dtypes or head dims on CUDA, and when
torch.compile traces it (context parallelism hands compile an opaque op instead:
fmeg.parallel.ring_attention), a block is computed explicitly; dropout masks each probability by its
global (batch row, head, query, key) position through `drop`, as the one-device attention does
(fmeg.ops.attention), so context parallelism keeps one device's mask.
"""

from __future__ import annotations

from typing import Callable

import torch

# (probs, q_pos, k_pos) -> dropped
Drop = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernel(q: torch.Tensor, drop: Drop | None) -> str | None:
    """The fused kernel a block of q runs on: "cpu" (flash), "cuda" (memory-efficient), or None
    (explicit)."""
    if drop is not None or torch.compiler.is_compiling():
        return None
    if q.device.type == "cpu":
        return "cpu"
    # the kernel's alignment for every dtype it takes
    aligned = q.shape[-1] % 8 == 0
    return "cuda" if q.device.type == "cuda" and q.dtype in _CUDA_DTYPES and aligned else None


def _lse_rows(n: int) -> int:
    """The rows of the memory-efficient kernel's lse: a multiple of 32."""
    return -(-n // 32) * 32


def cuda_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory-efficient kernel's (out, lse), lse cut to the block's rows (k, v with q's
    heads)."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal
    )
    return out, lse[..., : q.shape[2]]


def cuda_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The memory-efficient kernel's (dq, dk, dv) from the rows' merged out and fp32 lse (padded
    back to the rows its forward returns; no dropout, so its random-number state is never read)."""
    rows = q.shape[2]
    lse = torch.nn.functional.pad(lse.float(), (0, _lse_rows(rows) - rows)).contiguous()
    unused = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(),
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        None,
        out.contiguous(),
        lse,
        unused,
        unused,
        0.0,
        [True, True, True, False],
        causal,
    )
    return dq, dk, dv


def _accumulate(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _groups(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[1] == n else t.repeat_interleave(n // t.shape[1], dim=1)


def _fold_groups(t: torch.Tensor, g: int) -> torch.Tensor:
    """[b, N, s, d] gradients of repeated kv heads -> [b, G, s, d], summed over each group's query
    heads."""
    b, n, s, d = t.shape
    return t if n == g else t.reshape(b, g, n // g, s, d).sum(dim=2)


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    drop: Drop | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(d)) v, logsumexp of the scores) over this block's keys; q_pos, k_pos:
    the global positions of the block's queries and keys (used by drop only)."""
    n = q.shape[1]
    k, v = _groups(k, n), _groups(v, n)
    fused = kernel(q, drop)
    if fused == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        return out, lse.to(_accumulate(q))
    if fused == "cuda":
        out, lse = cuda_forward(q, k, v, causal)
        return out, lse.to(_accumulate(q))
    probs, lse = _probs(q, k, causal)
    if drop is not None:
        probs = drop(probs, q_pos, k_pos)
    return probs.to(q.dtype) @ v, lse


def _probs(q: torch.Tensor, k: torch.Tensor, causal: bool, lse: torch.Tensor | None = None):
    scores = (q @ k.transpose(-1, -2)).to(_accumulate(q)) * q.shape[-1] ** -0.5
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(
            ~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(), float("-inf")
        )
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.to(scores.dtype)[..., None]), lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    drop: Drop | None = None,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), given the rows' merged out and lse (see the module
    docstring)."""
    n, g = q.shape[1], k.shape[1]
    k, v = _groups(k, n), _groups(v, n)
    fused = kernel(q, drop)
    if fused == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q,
            k,
            v,
            out.to(q.dtype).contiguous(),
            lse.to(_accumulate(q)).contiguous(),
            0.0,
            causal,
        )
        return dq, _fold_groups(dk, g), _fold_groups(dv, g)
    if fused == "cuda":
        dq, dk, dv = cuda_backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, causal)
        return dq, _fold_groups(dk, g), _fold_groups(dv, g)
    probs, _ = _probs(q, k, causal, lse)
    compute = probs.dtype
    dprobs = dout.to(compute) @ v.to(compute).transpose(-1, -2)
    kept = probs
    # the mask (and its 1 / (1 - p)) scales both the probabilities and their gradients
    if drop is not None:
        scale = drop(torch.ones_like(probs), q_pos, k_pos)
        dprobs, kept = dprobs * scale, probs * scale
    delta = (dout.to(compute) * out.to(compute)).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * q.shape[-1] ** -0.5
    dq = dscores @ k.to(compute)
    dk = dscores.transpose(-1, -2) @ q.to(compute)
    dv = kept.transpose(-1, -2) @ dout.to(compute)
    return dq.to(q.dtype), _fold_groups(dk, g).to(q.dtype), _fold_groups(dv, g).to(q.dtype)


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over two disjoint key sets from each one's (out, lse); out accumulates in fp32
    or wider."""
    out_b = out_b.to(_accumulate(out_b))
    if out is None:
        return out_b, lse_b
    total = torch.logaddexp(lse, lse_b)
    return (
        out * torch.exp(lse - total)[..., None] + out_b * torch.exp(lse_b - total)[..., None]
    ), total
