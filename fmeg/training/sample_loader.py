"""Samples built off the training thread (Megatron's --num-workers): while a step runs, the next
iteration's microbatches are read from the datasets and collated on worker threads, so the step
waits on no data.

    # the microbatch starting at first
    loader = SampleLoader(workers=2, build=lambda dataset, first: microbatch)
    # built now, or taken from what was built ahead
    microbatches = loader.get(dataset, [first, ...])
    # start building the next iteration's, one per worker
    loader.ahead(dataset, [next_first, ...])

Threads, not processes: samples are memory-mapped reads, numpy and tokenizers (which release the
interpreter lock where they work), and the batches stay in this process with nothing to pickle.
--num-workers 0 builds each iteration's samples when it asks for them. A microbatch is a pure
function of (dataset, first sample), so building ahead changes no number.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


class SampleLoader:
    def __init__(self, workers: int, build: Callable):
        self.build = build
        self.pool = (
            ThreadPoolExecutor(workers, thread_name_prefix="fmeg-samples") if workers > 0 else None
        )
        self.pending: tuple[tuple, list[Future]] | None = None

    def get(self, dataset, firsts: list[int]) -> list:
        key = (id(dataset), tuple(firsts))
        if self.pending is not None and self.pending[0] == key:
            futures = self.pending[1]
            self.pending = None
            return [f.result() for f in futures]
        return [self.build(dataset, first) for first in firsts]

    def ahead(self, dataset, firsts: list[int]) -> None:
        if self.pool is not None:
            self.pending = (
                (id(dataset), tuple(firsts)),
                [self.pool.submit(self.build, dataset, f) for f in firsts],
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
