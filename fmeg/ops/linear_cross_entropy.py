"""Output projection and cross entropy in one differentiable op.

    loss = linear_cross_entropy(x, weight, labels, loss_mask=mask)
         == cross_entropy(x @ weight.T, labels, loss_mask=mask)      (the same numbers)

Why fuse: the [tokens, vocab] logits dominate a small model's step. The forward pass already holds
softmax(logits), so it keeps G = softmax - (1 - e) * onehot - e / V (zero on vocabulary padding),
the gradient of each token's loss with respect to its logits. Per-token weights (mask / count, times
the incoming gradient) then scale only the [tokens, hidden] operands of the two backward matmuls,
and the [tokens, vocab] tensor is read once per matmul and never rescaled. The softmax is taken in
fp32; G is kept in the compute dtype (x's), so with bf16 inputs every matmul, forward and backward,
runs in bf16 with fp32 accumulation, and the memory kept for backward is one [tokens, vocab] bf16
buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmeg.ops import weight_grads
from fmeg.ops.cross_entropy import IGNORE_INDEX
from fmeg.ops.precision import upcast


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * loss_i(x_i @ W.T); w (no gradient) carries the mask and the mean's 1 / count."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        w: torch.Tensor,
        smoothing: float,
        vocab_size: int,
    ):
        # all rows of weight: the padded vocabulary keeps the GEMM aligned
        logits = upcast(F.linear(x, weight))
        padded = logits.shape[-1] > vocab_size
        # padding ids take no part: probability 0, so no gradient either
        if padded:
            real = torch.arange(logits.shape[-1], device=logits.device) < vocab_size
            logits = logits.masked_fill(~real, float("-inf"))
        logprobs = torch.log_softmax(logits, dim=-1)
        safe = labels.clamp_min(0).unsqueeze(-1)
        losses = -logprobs.gather(-1, safe).squeeze(-1)
        if smoothing:
            losses = (1.0 - smoothing) * losses - smoothing * logprobs[..., :vocab_size].mean(-1)
        loss = (losses * w).sum()
        target = torch.full_like(safe, -(1.0 - smoothing), dtype=logprobs.dtype)
        uniform = smoothing / vocab_size
        if torch.compiler.is_compiling():
            # Dynamo traces this forward under autograd, where mutating a tensor that an earlier op
            # saved silently corrupted the weight gradient (torch 2.13); inductor fuses these
            # anyway.
            g = logprobs.exp().scatter_add(-1, safe, target)
            if smoothing:
                g = g - (uniform * real.to(g.dtype) if padded else uniform)
        else:
            # eager forward runs without autograd: reuse the [tokens, vocab] buffer
            g = logprobs.exp_()
            g.scatter_add_(-1, safe, target)
            if smoothing:
                g[..., :vocab_size].sub_(uniform)
        # kept in the compute dtype: the backward GEMMs run in it
        return loss, g.to(x.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, labels, w, _, _ = inputs
        _, g = output
        ctx.save_for_backward(x, weight, w, g)
        ctx.save_for_forward(x, weight, w, g)
        ctx.mark_non_differentiable(g)
        # g gets no gradient; don't allocate a [tokens, vocab] zero one
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_loss, _grad_g):
        x, weight, w, g = ctx.saved_tensors
        scale = (grad_loss * w).unsqueeze(-1)
        # Both gradients always: under torch.compile(torch.func.grad(...)) ctx.needs_input_grad said
        # False for the weight (torch 2.13) and skipping it silently zeroed the weight gradient.
        # The GEMMs run in the compute dtype (g's) with fp32 accumulation; the per-token scale goes
        # on the [tokens, hidden] operands, never on the [tokens, vocab] one.
        grad_x = ((g @ weight.to(g.dtype)) * scale).to(x.dtype)

        def grad_w() -> torch.Tensor:
            return (g.mT @ (x * scale).to(g.dtype)).to(weight.dtype)

        # a zero-bubble schedule's B leaves the weight's product to its W
        if not torch.compiler.is_compiling() and weight_grads.defer(weight, grad_w):
            return grad_x, None, None, None, None, None
        return grad_x, grad_w(), None, None, None, None


class _LinearCrossEntropyWithJvp(_LinearCrossEntropy):
    """The same op with a forward-mode rule. Dynamo cannot trace a Function that defines jvp (it
    breaks the graph), so compiled code uses the parent class and eager code, where jvp may be asked
    for, this."""

    @staticmethod
    def jvp(ctx, x_t, weight_t, _labels_t, _w_t, _smoothing_t, _vocab_size_t):
        x, weight, w, g = ctx.saved_tensors
        g = upcast(g)
        tangent = torch.zeros((), dtype=g.dtype, device=x.device)
        if x_t is not None:
            tangent = tangent + ((g @ weight.to(g.dtype)) * x_t.to(g.dtype) * w.unsqueeze(-1)).sum()
        if weight_t is not None:
            tangent = (
                tangent + ((g.mT @ (x.to(g.dtype) * w.unsqueeze(-1))) * weight_t.to(g.dtype)).sum()
            )
        return tangent, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Mean cross entropy of logits x @ weight.T over tokens with a valid label and nonzero mask
    (reduction "sum": the mask-weighted sum, Megatron's --calculate-per-token-loss numerator).

    x [..., hidden], weight [vocab, hidden], labels [...]. Equal to ops.cross_entropy(linear(x,
    weight), ...) in value and in gradients for x and weight, under autograd,
    torch.func.grad/vjp/jvp and vmap. vocab_size: only the first vocab_size rows of weight are
    classes; the rest (vocabulary padding) take no part and get a zero gradient, as with
    weight[:vocab_size], but the GEMMs keep the padded, aligned shape.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    valid = (labels != ignore_index).to(acc)
    mask = valid if loss_mask is None else valid * loss_mask.to(acc)
    w = (mask if reduction == "sum" else mask / mask.sum().clamp_min(1.0)).reshape(-1)
    safe_labels = torch.where(labels == ignore_index, 0, labels).reshape(-1)
    fn = _LinearCrossEntropy if torch.compiler.is_compiling() else _LinearCrossEntropyWithJvp
    loss, _ = fn.apply(
        x.reshape(-1, x.shape[-1]),
        weight,
        safe_labels,
        w,
        float(label_smoothing),
        weight.shape[0] if vocab_size is None else int(vocab_size),
    )
    return loss
