"""Which samples each data-parallel rank reads at each step, resumable from a consumed-sample count.

Both samplers yield, for every step, this rank's micro-batch of sample indices. A step consumes
micro_batch * dp samples; rank r reads positions [r * micro_batch, (r + 1) * micro_batch) of it.
"""

from __future__ import annotations

from typing import Iterator

import torch


def _check(total: int, consumed: int, micro_batch: int, dp: int, rank: int) -> None:
    if total <= 0:
        raise ValueError(f"sampler: no samples (total {total})")
    if micro_batch <= 0 or dp <= 0 or not 0 <= rank < dp:
        raise ValueError(
            f"sampler: need micro_batch > 0, dp > 0 and 0 <= rank < dp; got {micro_batch}, {dp}, "
            f"{rank}"
        )
    if consumed < 0:
        raise ValueError(f"sampler: consumed samples must be >= 0, got {consumed}")


def sequential_batches(
    total: int, consumed: int, micro_batch: int, dp: int, rank: int
) -> Iterator[list[int]]:
    """Samples in order from `consumed`, in steps of micro_batch * dp (a last partial step is
    dropped)."""
    _check(total, consumed, micro_batch, dp, rank)
    step = micro_batch * dp
    for start in range(consumed, total - step + 1, step):
        yield list(range(start + rank * micro_batch, start + (rank + 1) * micro_batch))


def cyclic_random_batches(
    total: int, consumed: int, micro_batch: int, dp: int, rank: int, seed: int = 0
) -> Iterator[list[int]]:
    """Endless random order: epoch e is a permutation (seeded by seed + e) of the samples a whole
    number of steps covers; resuming at any consumed count continues the same sequence."""
    _check(total, consumed, micro_batch, dp, rank)
    step = micro_batch * dp
    active = total - total % step
    if active == 0:
        raise ValueError(f"sampler: {total} samples are fewer than one step of {step}")
    while True:
        epoch, offset = divmod(consumed, active)
        order = torch.randperm(
            active, generator=torch.Generator().manual_seed(seed + epoch)
        ).tolist()
        for start in range(offset - offset % step, active, step):
            yield order[start + rank * micro_batch : start + (rank + 1) * micro_batch]
            consumed = epoch * active + start + step
