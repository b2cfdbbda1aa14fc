"""Check that a sharded function equals its unsharded reference: forward, gradients, vjp, vmap
and jvp, on thread ranks and on gloo processes.

    def sharded(mesh, p, x):                   # each rank's program: its shard of the params
        tp = TensorParallel(mesh.group("tp"))
        h = column_parallel_linear(x, p["fc1"]["weight"], None, tp)
        return row_parallel_linear(torch.tanh(h), p["fc2"]["weight"], None, tp)

    def reference(p, x):                       # the same on one device, the whole params
        return torch.tanh(x @ p["fc1"]["weight"].T) @ p["fc2"]["weight"].T

    rules = (("fc1.weight", Partition(-2)), ("fc2.weight", Partition(-1)))
    check_sharded(sharded, reference, params, x, rules, world=2)

The sharding contract checked, for a random cotangent c of the full output and a random tangent t
of x, on every rank of the "tp" axis:
- forward: the rank's output is the full output (output=None) or its chunk (output=Partition(dim));
- grad: the gradient of <output, c> with respect to the rank's params is the slice `rules` cut of
  the reference's gradient (replicated leaves: the whole gradient);
- vjp: the vjp of c with respect to x (replicated on every rank) is the reference's;
- vmap: vmapped over a leading batch of x, the outputs are the reference's vmapped;
- jvp: the jvp of t is the reference's, on gloo processes only (forward-mode AD levels are global
  to a process, so thread ranks cannot run it at once).
An integer x (token ids) has no vjp or jvp. A check that fails raises ShardingMismatch naming the
check, the backend, the rank, the leaf, the largest difference and where it is, and the tolerance.
On gloo, sharded_fn must be importable (defined at module level, not in a notebook cell).
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from fmeg import tree
from fmeg.parallel.sharding import Partition, Rules, shard
from fmeg.parallel.spmd import GlooRanks, run_threads

CHECKS = ("forward", "grad", "vjp", "vmap", "jvp")
BACKENDS = ("threads", "gloo")

# gloo pools stay up between checks (starting one costs seconds)
_POOLS: dict[int, GlooRanks] = {}


class ShardingMismatch(AssertionError):
    """A sharded function differs from its reference; the message says where and by how much."""


@dataclass(frozen=True)
class Checked:
    """What check_sharded compared: (check, backend) pairs, and the checks it could not run with
    why."""

    compared: tuple[tuple[str, str], ...]
    skipped: tuple[tuple[str, str], ...]


def check_sharded(
    sharded_fn: Callable[..., Any],
    reference_fn: Callable[..., Any],
    params: Any,
    x: torch.Tensor,
    rules: Rules = (),
    *,
    output: Partition | None = None,
    world: int = 2,
    backends: Sequence[str] = BACKENDS,
    checks: Sequence[str] = CHECKS,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    vmap_batch: int = 3,
    sequence_parallel: bool = False,
    timeout: float = 120.0,
) -> Checked:
    """Raise ShardingMismatch unless sharded_fn(mesh, local_params, x) on `world` tensor-parallel
    ranks equals reference_fn(params, x) as the module docstring states. params: the full pytree,
    cut for each rank by `rules` (fmeg.parallel.sharding) on the "tp" axis; output: None when every
    rank holds the whole output, Partition(dim) when rank r holds its r-th chunk along dim."""
    unknown = sorted(set(checks) - set(CHECKS)) + sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"check_sharded: unknown {unknown}; checks {CHECKS}, backends {BACKENDS}")
    want = _reference(reference_fn, params, x, seed, vmap_batch, checks)
    compared, skipped = [], []
    for backend in backends:
        run = _runner(backend, world, timeout)
        results = run(
            _rank_program,
            sharded_fn,
            tuple(rules),
            output,
            params,
            want["inputs"],
            tuple(checks),
            sequence_parallel=sequence_parallel,
            tp=world,
        )
        for rank, got in enumerate(results):
            for check, value in got.items():
                expected = _expected(check, want, rules, output, rank, world)
                _compare(check, backend, rank, value, expected, rtol, atol)
        ran = set(results[0])
        compared += [(c, backend) for c in checks if c in ran]
        skipped += [(c, _why_not(c, backend, x)) for c in checks if c not in ran]
    return Checked(tuple(compared), tuple(dict.fromkeys(skipped)))


def _reference(reference_fn, params, x, seed, vmap_batch, checks) -> dict:
    """The reference's values of every check, and the random cotangent, tangent and batch."""
    g = torch.Generator().manual_seed(seed)
    out = reference_fn(params, x)
    cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
    differentiable = x.is_floating_point()
    tan = torch.randn(x.shape, generator=g, dtype=x.dtype) if differentiable else None
    if differentiable:
        batch = torch.randn((vmap_batch, *x.shape), generator=g, dtype=x.dtype)
    else:
        batch = torch.stack([x.roll(k, dims=-1) for k in range(vmap_batch)])
    want: dict[str, Any] = {"forward": out, "inputs": (x, cot, tan, batch)}
    if "grad" in checks:
        want["grad"] = torch.func.grad(lambda p: (reference_fn(p, x) * cot).sum())(params)
    if "vjp" in checks and differentiable:
        want["vjp"] = torch.func.vjp(lambda x: reference_fn(params, x), x)[1](cot)[0]
    if "vmap" in checks:
        want["vmap"] = torch.func.vmap(lambda x: reference_fn(params, x))(batch)
    if "jvp" in checks and differentiable:
        want["jvp"] = torch.func.jvp(lambda x: reference_fn(params, x), (x,), (tan,))[1]
    return want


def _rank_program(mesh, sharded_fn, rules, output, params, inputs, checks) -> dict:
    """One rank's values of every check it can run (module level: gloo ranks import it)."""
    x, cot, tan, batch = inputs
    rank, size = mesh.coord("tp"), mesh.size("tp")
    local = shard(params, rules, {"tp": (rank, size)})
    cot = _chunk(cot, output, rank, size)

    def fn(x):
        return sharded_fn(mesh, local, x)

    got: dict[str, Any] = {}
    if "forward" in checks:
        got["forward"] = fn(x)
    if "grad" in checks:
        got["grad"] = torch.func.grad(lambda p: (sharded_fn(mesh, p, x) * cot).sum())(local)
    differentiable = x.is_floating_point()
    if "vjp" in checks and differentiable:
        got["vjp"] = torch.func.vjp(fn, x)[1](cot)[0]
    if "vmap" in checks:
        got["vmap"] = torch.func.vmap(fn)(batch)
    in_thread = threading.current_thread() is not threading.main_thread()
    if "jvp" in checks and differentiable and not in_thread:
        got["jvp"] = torch.func.jvp(fn, (x,), (tan,))[1]
    return got


def _expected(check: str, want: dict, rules, output, rank: int, world: int) -> Any:
    """The part of the reference's value that this rank's value must equal."""
    if check == "grad":
        return shard(want["grad"], rules, {"tp": (rank, world)})
    if check == "vjp":
        return want["vjp"]
    # a vmapped output has the batch dimension in front
    shift = 1 if check == "vmap" and output is not None and output.dim >= 0 else 0
    part = None if output is None else Partition(output.dim + shift, output.axis)
    return _chunk(want[check], part, rank, world)


def _chunk(value: torch.Tensor, part: Partition | None, rank: int, size: int) -> torch.Tensor:
    return value if part is None else value.chunk(size, dim=part.dim)[rank]


def _compare(check, backend, rank, got, want, rtol, atol) -> None:
    """Raise ShardingMismatch at the first leaf of got that differs from want."""
    got_leaves = tree.flatten(got) if not torch.is_tensor(got) else {"output": got}
    want_leaves = tree.flatten(want) if not torch.is_tensor(want) else {"output": want}
    where = f"check_sharded: {check} on {backend}, rank {rank}"
    if got_leaves.keys() != want_leaves.keys():
        raise ShardingMismatch(
            f"{where}: leaves {sorted(got_leaves)} where the reference has {sorted(want_leaves)}"
        )
    for name, g in got_leaves.items():
        w = want_leaves[name]
        if g.shape != w.shape:
            raise ShardingMismatch(
                f"{where}, {name}: shape {tuple(g.shape)} where the reference's part is "
                f"{tuple(w.shape)}"
            )
        g, w = g.detach().double(), w.detach().double()
        excess = (g - w).abs() - (atol + rtol * w.abs())
        if bool((excess > 0).any()) or bool(g.isnan().ne(w.isnan()).any()):
            index = tuple(
                int(i) for i in torch.unravel_index(excess.nan_to_num(1e300).argmax(), g.shape)
            )
            diff = float((g - w).abs().nan_to_num(float("inf")).max())
            raise ShardingMismatch(
                f"{where}, {name}: largest difference {diff:.3g} at index {index} (sharded "
                f"{float(g[index]):.6g}, reference {float(w[index]):.6g}), beyond rtol {rtol:g}, "
                f"atol {atol:g}"
            )


def _why_not(check: str, backend: str, x: torch.Tensor) -> str:
    if check in ("vjp", "jvp") and not x.is_floating_point():
        return f"{check}: x holds integers (no tangent or cotangent)"
    return f"{check}: not on {backend} (forward-mode AD levels are global to a process); use gloo"


def _runner(backend: str, world: int, timeout: float) -> Callable[..., list]:
    if backend == "threads":
        return lambda fn, *args, **sizes: run_threads(world, fn, *args, timeout=timeout, **sizes)
    if world not in _POOLS:
        _POOLS[world] = GlooRanks(world, timeout=timeout)
    return _POOLS[world].run


def close_pools() -> None:
    """Stop the gloo processes check_sharded started (also done at exit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)
