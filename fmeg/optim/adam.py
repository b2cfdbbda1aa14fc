"""AdamW, one definition in two forms: the chain of transforms over pytrees, and the same update
stepped in place over the runner's flat buffers by torch's fused kernel.

    opt = adamw(b1=0.9, b2=0.999, eps=1e-8)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params, lr=lr, weight_decay=wd)
    opt.flat.step_(views, steps, group, lr=lr, weight_decay=wd, grad_scale=clip)   # the flat form

The update torch.optim.AdamW makes, with Megatron's decay mask and --decoupled-lr:

    p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * mask * p)

The flat form divides the gradient by grad_scale inside the kernel: global-norm clipping
(clip_scale) with no pass of its own. tests/optim/test_optim.py holds the two forms equal.
"""

from __future__ import annotations

import math

from typing import NamedTuple

import torch

from fmeg.optim.base import GradientTransformation, chain
from fmeg.optim.transforms import (
    Mask,
    add_decayed_weights,
    default_decay_mask,
    scale_by_adam,
    scale_by_learning_rate,
    step_group,
)

Dtypes = tuple[torch.dtype, torch.dtype]

# elements widened to fp32 at a time: the scratch a step of moments stored in bf16 needs
NARROW_CHUNK = 1 << 22


class FusedAdamW(NamedTuple):
    """adamw's update over flat fp32 buffers (master weights, gradient) and moment buffers in
    moment_dtypes, in place: torch._fused_adamw_ per group of leaves sharing (decoupled lr?,
    decays?)."""

    b1: float
    b2: float
    eps: float
    moment_dtypes: Dtypes
    decay_mask: Mask
    decoupled: Mask | None

    def group(self, path: str, leaf: torch.Tensor) -> tuple[bool, bool]:
        """(takes decoupled_lr?, decays?) for a leaf: the leaves one kernel call steps together."""
        return step_group(self.decoupled, self.decay_mask, path, leaf)

    def step_(
        self,
        views: list[list[torch.Tensor]],
        steps: list[torch.Tensor],
        group: tuple[bool, bool],
        *,
        lr: float,
        weight_decay: float,
        decoupled_lr: float | None = None,
        grad_scale: torch.Tensor | None = None,
        exact: bool = False,
    ) -> None:
        """One group's [master, grad, mu, nu] lists of views stepped in place; steps: the step count
        per view, device tensors already advanced. exact (--deterministic-mode): each element's
        result the same bits however the buffers are cut into views (_step_rounded_each)."""
        decoupled, decays = group
        options = dict(
            lr=decoupled_lr if decoupled and decoupled_lr is not None else lr,
            beta1=self.b1,
            beta2=self.b2,
            weight_decay=weight_decay if decays else 0.0,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
        )
        if exact:
            _step_rounded_each(views, steps, options)
        elif self.moment_dtypes == (torch.float32, torch.float32):
            torch._fused_adamw_(*views, [], steps, **options)
        else:
            _step_narrow_moments(views, steps, options)


def adamw(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    decay_mask: Mask = default_decay_mask,
    moment_dtypes: Dtypes = (torch.float32, torch.float32),
    decoupled: Mask | None = None,
) -> GradientTransformation:
    """Adam with bias correction and decoupled weight decay. decay_mask(path, leaf): a bool per
    leaf, or a 0/1 tensor of its shape; moment_dtypes: the moments' storage (bf16: Megatron's
    precision-aware optimizer); decoupled(path, leaf): the leaves update's decoupled_lr applies
    to."""
    pytree = chain(
        scale_by_adam(b1, b2, eps, moment_dtypes),
        add_decayed_weights(decay_mask),
        scale_by_learning_rate(decoupled),
    )
    return pytree._replace(flat=FusedAdamW(b1, b2, eps, moment_dtypes, decay_mask, decoupled))


def clip_scale(norm: torch.Tensor, clip_grad: float) -> torch.Tensor | None:
    """The fused kernel's grad_scale for global-norm clipping (it divides the gradient by it): the
    clip of clip_by_global_norm with no pass of its own and no host sync."""
    return ((norm + 1e-6) / clip_grad).clamp(min=1.0).float() if clip_grad else None


def _step_rounded_each(
    views: list[list[torch.Tensor]], steps: list[torch.Tensor], options: dict
) -> None:
    """The fused kernel's AdamW as single operations, each rounded once: the fused kernel's vector
    loop contracts multiply-adds that its scalar tail rounds twice, so an element's bits depend on
    where its view starts and ends, which ZeRO's slices move. Slower (a pass per operation), for
    --deterministic-mode; moments of any dtype, computed in fp32."""
    b1, b2, eps, lr, wd = (options[k] for k in ("beta1", "beta2", "eps", "lr", "weight_decay"))
    scale = options["grad_scale"]
    for master, grad, mu, nu, step in zip(*views, steps):
        g = grad / scale if scale is not None else grad
        m, v = mu.float(), nu.float()
        if wd:
            master.mul_(1 - lr * wd)
        m.mul_(b1).add_(g * (1 - b1))
        v.mul_(b2).add_((g * g).mul_(1 - b2))
        count = step.item()
        denom = v.sqrt().div_(math.sqrt(1 - b2**count)).add_(eps)
        master.sub_((m / denom).mul_(lr / (1 - b1**count)))
        if m.data_ptr() != mu.data_ptr():
            mu.copy_(m)
            nu.copy_(v)


def _step_narrow_moments(
    views: list[list[torch.Tensor]], steps: list[torch.Tensor], options: dict
) -> None:
    """The fused step over moments stored narrower (bf16), as Megatron's precision-aware optimizer
    runs it: each chunk's moments widened to fp32, stepped with the fp32 master and gradient,
    rounded back."""
    master, grad, mu, nu = views
    for i in range(len(master)):
        for a in range(0, master[i].numel(), NARROW_CHUNK):
            part = slice(a, a + NARROW_CHUNK)
            m, v = mu[i][part].float(), nu[i][part].float()
            torch._fused_adamw_(
                [master[i][part]], [grad[i][part]], [m], [v], [], [steps[i]], **options
            )
            mu[i][part].copy_(m)
            nu[i][part].copy_(v)
