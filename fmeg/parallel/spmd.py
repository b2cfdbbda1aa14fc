"""Run one SPMD function on several ranks, from one Python process.

    results = run_threads(4, fn, x, tp=4)             # ranks are threads; fn(mesh, x) on each
    with GlooRanks(4) as ranks:                      # ranks are gloo processes on 127.0.0.1
        results = ranks.run(fn, x, tp=2)

Either way fn receives a Mesh for its rank (built with the given group sizes) and the same
arguments, and the call returns the list of per-rank results. Threads start in milliseconds and suit
notebooks and property tests; gloo processes are the ground truth (real torch.distributed, real
serialisation). A rank that fails or hangs fails the call within `timeout` seconds instead of
blocking.
"""

from __future__ import annotations

import os
import socket
import threading
import traceback
from typing import Any, Callable

import torch

from fmeg.parallel.comm import ThreadWorld
from fmeg.parallel.mesh import Mesh


def run_threads(
    world_size: int,
    fn: Callable,
    *args: Any,
    timeout: float = 60.0,
    sequence_parallel: bool = False,
    **sizes: Any,
) -> list[Any]:
    """fn(mesh, *args) on world_size ranks that are threads of this process."""
    world = ThreadWorld(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def rank_main(rank: int) -> None:
        try:
            mesh = Mesh.build(
                rank,
                world_size,
                lambda ranks: world.group(ranks, rank),
                sequence_parallel=sequence_parallel,
                **sizes,
            )
            results[rank] = fn(mesh, *args)
        except BaseException as e:  # noqa: BLE001 - reported below, after waking the other ranks
            errors.append((rank, e))
            world.abort()

    threads = [
        threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        world.abort()
        raise TimeoutError(
            f"run_threads: ranks still running after {timeout} s (a collective mismatch?)"
        )
    if errors:
        first = next(
            (e for e in errors if not isinstance(e[1], threading.BrokenBarrierError)), errors[0]
        )
        raise RuntimeError(f"rank {first[0]} failed: {first[1]!r}") from first[1]
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank_main(rank: int, world_size: int, port: int, conn: Any, timeout: float) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    # loopback only: tests never leave the machine
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    meshes: dict[tuple, Mesh] = {}
    try:
        while True:
            task = conn.recv()
            if task is None:
                break
            fn, args, sp, sizes = task
            try:
                key = tuple(sorted(sizes.items()))
                if key not in meshes:
                    meshes[key] = Mesh.from_torch_distributed(**sizes)
                mesh = meshes[key]
                mesh.sequence_parallel = sp
                conn.send(("ok", fn(mesh, *args)))
            except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class GlooRanks:
    """world_size gloo processes on 127.0.0.1 that stay up between calls (start-up costs
    seconds)."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        import torch.multiprocessing as mp

        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_gloo_rank_main, args=(rank, world_size, port, child, timeout), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def run(
        self, fn: Callable, *args: Any, sequence_parallel: bool = False, **sizes: Any
    ) -> list[Any]:
        """fn(mesh, *args) on every rank; fn must be importable (a module-level function)."""
        for conn in self._conns:
            conn.send((fn, args, sequence_parallel, sizes))
        results = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout):
                self.close(force=True)
                raise TimeoutError(f"GlooRanks: rank {rank} gave no result within {self.timeout} s")
            status, value = conn.recv()
            if status == "error":
                self.close(force=True)
                raise RuntimeError(f"GlooRanks: rank {rank} failed:\n{value}")
            results.append(value)
        return results

    def close(self, force: bool = False) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(5 if not force else 0.1)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []

    def __enter__(self) -> "GlooRanks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
