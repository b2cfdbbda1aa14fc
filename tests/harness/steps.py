"""Megatron's own pieces as oracles of the runner's: its loss scaler and its step batch
schedule."""

import pytest
import torch


def megatron_scaler(monkeypatch, initial: float, min_scale: float, window: int, hysteresis: int):
    """megatron-core's DynamicGradScaler as Megatron's training builds it (growth 2, backoff 0.5),
    with its tensors on the CPU (it puts them on CUDA)."""
    from types import SimpleNamespace

    grad_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")
    cpu_torch = SimpleNamespace(
        tensor=lambda *a, device=None, **k: torch.tensor(*a, **k), max=torch.max, float=torch.float
    )
    monkeypatch.setattr(grad_scaler, "torch", cpu_torch)
    return grad_scaler.DynamicGradScaler(
        initial_scale=initial,
        min_scale=min_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=window,
        hysteresis=hysteresis,
    )


def megatron_step_batch(schedule: str, seq_length: int, consumed: int) -> int:
    """Megatron's StepBatchsizeNumMicroBatchesCalculator, as its docstring defines it: entries
    'THRESHOLD:BATCH' with K/M/B/T suffixes, thresholds in tokens turned into samples by //
    seq_length, the batch of the last threshold at or below the samples consumed."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
    pairs = []
    for entry in schedule.replace(",", " ").split():
        t, b = entry.split(":")
        t = int(float(t[:-1]) * scale[t[-1].upper()]) if t[-1].upper() in scale else int(t)
        pairs.append((t // seq_length, int(b)))
    return max(pairs, key=lambda p: p[0] if p[0] <= consumed else -1)[1]
