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
check, the backend, the rank, what differs (a parameter's path for grad, "x's cotangent" for vjp,
"output's tangent" for jvp, "output" otherwise), the largest difference and where it is, and the
tolerance; a sharded output of the wrong shape fails the forward check with both shapes.
Arguments that cannot be checked (world < 1, rules that do not cut params, an output partition
the reference's output has no dimension for) raise ValueError or TypeError naming the argument
before any rank starts. A rule matching no leaf of params is allowed (a model's rule set covers
leaves a small configuration lacks), but a failure after it names the rule and the leaves there
are. On gloo, sharded_fn must be importable (defined at module level, not in a notebook cell).
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable, Sequence

import torch

from fmeg import tree
from fmeg.parallel.sharding import Partition, Rules, partition_of, shard, splits
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
    rank holds the whole output, Partition(dim) when rank r holds its r-th chunk along dim.

    Before any rank starts: ValueError for unknown checks or backends, world < 1, vmap_batch < 1,
    a rule whose dimension a leaf lacks or does not split over world, or an output partition the
    reference's output has no dimension for (or whose dimension does not split); TypeError for
    rules that are not (pattern, Partition) pairs, an x or reference output that is not a tensor.
    A rule matching no leaf is no error by itself; if the check then fails, a rank's exception
    comes back as ValueError naming those rules and the leaves there are (the ShardingMismatch
    message names them too)."""
    unknown = sorted(set(checks) - set(CHECKS)) + sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"check_sharded: unknown {unknown}; checks {CHECKS}, backends {BACKENDS}")
    rules = tuple(rules)
    _check_arguments(params, x, rules, output, world, vmap_batch)
    want = _reference(reference_fn, params, x, seed, vmap_batch, checks)
    _check_output(output, want["forward"], world)
    unmatched = _unmatched(params, rules)
    compared, skipped = [], []
    for backend in backends:
        run = _runner(backend, world, timeout)
        try:
            results = run(
                _rank_program,
                sharded_fn,
                rules,
                output,
                params,
                want["inputs"],
                tuple(checks),
                sequence_parallel=sequence_parallel,
                tp=world,
            )
        except Exception as e:
            # a failed gloo run leaves its processes stopped: the next check starts a new pool
            if backend == "gloo":
                _POOLS.pop(world).close(force=True)
            if unmatched:
                raise ValueError(
                    f"check_sharded: {unmatched}, and then sharded_fn failed on {backend}: {e}"
                ) from e
            raise
        try:
            for rank, got in enumerate(results):
                for check, value in got.items():
                    expected = _expected(check, want, rules, output, rank, world)
                    _compare(check, backend, rank, value, expected, rtol, atol)
        except ShardingMismatch as e:
            if unmatched:
                raise ShardingMismatch(f"{e}; note: {unmatched}") from None
            raise
        ran = set(results[0])
        compared += [(c, backend) for c in checks if c in ran]
        skipped += [(c, _why_not(c, backend, x)) for c in checks if c not in ran]
    return Checked(tuple(compared), tuple(dict.fromkeys(skipped)))


def _check_arguments(params, x, rules, output, world, vmap_batch) -> None:
    """Raise ValueError or TypeError naming the argument check_sharded cannot run with."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"check_sharded: world must be an integer >= 1, not {world!r}")
    if isinstance(vmap_batch, bool) or not isinstance(vmap_batch, int) or vmap_batch < 1:
        raise ValueError(f"check_sharded: vmap_batch must be an integer >= 1, not {vmap_batch!r}")
    if not torch.is_tensor(x):
        raise TypeError(f"check_sharded: x must be a tensor, not {type(x).__name__}")
    if output is not None and not isinstance(output, Partition):
        raise TypeError(f"check_sharded: output must be None or a Partition, not {output!r}")
    if output is not None and output.axis != "tp":
        raise ValueError(
            f"check_sharded: output={output} is on axis {output.axis!r}; the ranks are the "
            '"tp" axis'
        )
    for rule in rules:
        if not (
            isinstance(rule, tuple)
            and len(rule) == 2
            and isinstance(rule[0], str)
            and isinstance(rule[1], Partition)
        ):
            raise TypeError(
                f"check_sharded: rules must be (pattern, Partition) pairs, e.g. "
                f'(("fc1.weight", Partition(-2)),); got {rule!r}'
            )
    for path, leaf in tree.items(params):
        part = partition_of(path, rules, "tp")
        if part is None:
            continue
        if not -leaf.ndim <= part.dim < leaf.ndim:
            raise ValueError(
                f"check_sharded: rules cut {path} of shape {tuple(leaf.shape)} along dim "
                f"{part.dim}, which it does not have"
            )
        # the same cut shard makes on every rank: a dimension that does not split is refused here,
        # before the ranks start, rather than inside one of them
        for _, dim, _, size in splits(path, rules, {"tp": (0, world)}):
            if leaf.shape[dim] % size:
                raise ValueError(
                    f"check_sharded: rules cut {path} of shape {tuple(leaf.shape)} along dim "
                    f"{dim}, of size {leaf.shape[dim]}, which does not split over world={world}"
                )


def _check_output(output: Partition | None, out: Any, world: int) -> None:
    """Raise TypeError unless the reference's output is a tensor, ValueError unless `output`
    names one of its dimensions and that dimension splits over world."""
    if not torch.is_tensor(out):
        raise TypeError(
            f"check_sharded: reference_fn must return one tensor, not {type(out).__name__}"
        )
    if output is None:
        return
    if not -out.ndim <= output.dim < out.ndim:
        raise ValueError(
            f"check_sharded: output={output}: dim {output.dim} is out of range for the "
            f"reference's output of {out.ndim} dims (shape {tuple(out.shape)})"
        )
    if out.shape[output.dim] % world:
        raise ValueError(
            f"check_sharded: output={output}: dim {output.dim} of the reference's output "
            f"(shape {tuple(out.shape)}) does not split over world={world}"
        )


def _unmatched(params: Any, rules: Rules) -> str:
    """A sentence naming the rules that match no leaf of params, with the leaves there are; "" when
    every rule matches one."""
    paths = [path for path, _ in tree.items(params)]
    patterns = [pattern for pattern, _ in rules if not any(fnmatchcase(p, pattern) for p in paths)]
    if not patterns:
        return ""
    # a model's params have hundreds of leaves: the first few say enough
    shown = ", ".join(paths[:12]) + (f", ... ({len(paths)} in all)" if len(paths) > 12 else "")
    return f"rules {patterns} match no leaf of params (its leaves: {shown or 'none'})"


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
    """One rank's values of every check it can run (module level: gloo ranks import it). The
    forward runs whatever the checks; if any rank's output is not of its expected shape, every rank
    returns its forward alone."""
    x, cot, tan, batch = inputs
    rank, size = mesh.coord("tp"), mesh.size("tp")
    local = shard(params, rules, {"tp": (rank, size)})
    cot = _chunk(cot, output, rank, size)

    def fn(x):
        return sharded_fn(mesh, local, x)

    got: dict[str, Any] = {"forward": fn(x)}
    out = got["forward"]
    wrong = not torch.is_tensor(out) or out.shape != cot.shape
    # every rank stops after the forward if one's output has the wrong shape (the others would
    # wait for it in the gradients' collectives); the caller's forward check then names the shapes
    group = mesh.group("tp")
    if group is not None:
        wrong = bool(group.all_reduce(torch.tensor([float(wrong)])).item() > 0)
    if wrong:
        return got
    if "forward" not in checks:
        del got["forward"]
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


# what a check's single tensor is, in a ShardingMismatch message (grad names parameters' paths)
_NAMES = {"vjp": "x's cotangent", "jvp": "output's tangent"}


def _compare(check, backend, rank, got, want, rtol, atol) -> None:
    """Raise ShardingMismatch at the first leaf of got that differs from want."""
    name = _NAMES.get(check, "output")
    got_leaves = tree.flatten(got) if not torch.is_tensor(got) else {name: got}
    want_leaves = tree.flatten(want) if not torch.is_tensor(want) else {name: want}
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
