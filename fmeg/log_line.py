"""Megatron's training log line, as a pure function of the numbers it shows."""

from __future__ import annotations


def megatron_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    lr: float,
    global_batch_size: int,
    lm_loss: float,
    grad_norm: float | None,
    loss_scale: float = 1.0,
    tflops: float | None = None,
    params_norm: float | None = None,
    skipped: int = 0,
    nans: int = 0,
    other_losses: dict[str, float] | None = None,
) -> str:
    """' iteration       10/     200 | consumed samples: ... | number of nan iterations:   0 |'.
    other_losses (a mixture of experts' load_balancing_loss, z_loss) follow the lm loss, as Megatron
    prints them."""
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if tflops is not None:
        parts.append(f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
    parts += [
        f"learning rate: {lr:.6E}",
        f"global batch size: {global_batch_size:5d}",
        f"lm loss: {lm_loss:.6E}",
    ]
    parts += [f"{name}: {value:.6E}" for name, value in (other_losses or {}).items()]
    parts.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    if params_norm is not None:
        parts.append(f"params norm: {params_norm:.3f}")
    parts += [f"number of skipped iterations: {skipped:3d}", f"number of nan iterations: {nans:3d}"]
    return " | ".join(parts) + " |"
