"""Runs a per-rank program on thread ranks or on gloo processes (2 and 4), for the property
tests."""

from __future__ import annotations

import pytest

from fmeg.parallel.spmd import GlooRanks, run_threads

_POOLS: dict[int, GlooRanks] = {}


def gloo(world_size: int) -> GlooRanks:
    """A gloo pool of world_size ranks, started once per test session."""
    if world_size not in _POOLS:
        _POOLS[world_size] = GlooRanks(world_size, timeout=120)
    return _POOLS[world_size]


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run(backend: str, world_size: int, fn, *args, **kwargs):
    if backend == "threads":
        return run_threads(world_size, fn, *args, **({"tp": world_size} | kwargs))
    if world_size == 1:
        pytest.skip("gloo runs use 2 or 4 ranks")
    return gloo(world_size).run(fn, *args, **({"tp": world_size} | kwargs))
