"""Differentiable collectives: Megatron's tensor-parallel regions as autograd Functions.

| function                     | forward                | backward                  |
|------------------------------|------------------------|---------------------------|
| copy_to(x, g)                | identity               | all-reduce                |
| reduce_from(x, g)            | all-reduce             | identity                  |
| scatter_to(x, g, dim)        | keep this rank's chunk | all-gather                |
| gather_from(x, g, dim)       | all-gather             | keep this rank's chunk    |
| gather_from_sp(x, g, dim)    | all-gather             | reduce-scatter            |
| reduce_scatter_to(x, g, dim) | reduce-scatter         | all-gather                |
| all_to_all(x, g, s, c)       | all-to-all (s -> c)    | all-to-all (c -> s)       |
| all_to_all_rows(x, g, s, r)  | uneven all-to-all      | the same, s and r swapped |

Each forward is linear, so its jvp applies the same forward to the tangent; each has a vmap rule
that moves the batch dimension to the front and shifts `dim`. They compose with torch.func.grad,
vjp, jvp and vmap (setup_context style). A group of None (a single rank) makes every function the
identity. Inputs are never mutated.

Under torch.compile each region is a twin Function with the same forward and backward and no jvp or
vmap rule (dynamo does not trace Functions that define a custom jvp), and TorchGroup switches to
functional collectives, so a compiled tensor-parallel layer is one graph with its collectives
inside.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# fmeg.parallel.comm.Group or None
Group = Any


def _chunk(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    if x.shape[dim] % g.size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split evenly over {g.size} ranks"
        )
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


# Primitive maps: (x, group, dims) -> tensor. Backward and jvp of each region are built from them.
_PRIMS: dict[str, Callable] = {
    "identity": lambda x, g, d: x.clone(),
    "all_reduce": lambda x, g, d: g.all_reduce(x),
    "split": lambda x, g, d: _chunk(x, g, d[0]),
    "all_gather": lambda x, g, d: g.all_gather(x, d[0]),
    "reduce_scatter": lambda x, g, d: g.reduce_scatter(x, d[0]),
    "all_to_all": lambda x, g, d: g.all_to_all(x, d[0], d[1]),
    "all_to_all_back": lambda x, g, d: g.all_to_all(x, d[1], d[0]),
}


def _region(
    name: str, forward: str, backward: str, traceable: bool = False
) -> type[torch.autograd.Function]:
    """An autograd Function whose forward is _PRIMS[forward] and whose backward is _PRIMS[backward],
    with jvp and vmap rules unless `traceable` (the twin that torch.compile traces)."""

    def fwd(x, group, dims):
        return _PRIMS[forward](x, group, dims)

    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dims = inputs

    def bwd(ctx, grad):
        return _PRIMS[backward](grad, ctx.group, ctx.dims), None, None

    def jvp(ctx, x_t, _group_t, _dims_t):
        return _PRIMS[forward](x_t, ctx.group, ctx.dims)

    def vmap(info, in_dims, x, group, dims):
        if in_dims[0] is None:
            return cls.apply(x, group, dims), None
        x = x.movedim(in_dims[0], 0)
        rank = x.dim() - 1
        shifted = tuple(d % rank + 1 for d in dims)
        return cls.apply(x, group, shifted), 0

    rules = {
        "forward": staticmethod(fwd),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(bwd),
    }
    if not traceable:
        rules.update(jvp=staticmethod(jvp), vmap=staticmethod(vmap))
    cls = type(name, (torch.autograd.Function,), rules)
    return cls


def _twins(name: str, forward: str, backward: str) -> tuple[type, type]:
    """(the eager Function with every torch.func rule, its traceable twin)."""
    return _region(name, forward, backward), _region(
        name + "Traced", forward, backward, traceable=True
    )


def _apply(twins: tuple[type, type], *args: Any) -> torch.Tensor:
    return twins[1 if torch.compiler.is_compiling() else 0].apply(*args)


_CopyTo = _twins("_CopyTo", "identity", "all_reduce")
_ReduceFrom = _twins("_ReduceFrom", "all_reduce", "identity")
_ScatterTo = _twins("_ScatterTo", "split", "all_gather")
_GatherFrom = _twins("_GatherFrom", "all_gather", "split")
_GatherFromSP = _twins("_GatherFromSP", "all_gather", "reduce_scatter")
_ReduceScatterTo = _twins("_ReduceScatterTo", "reduce_scatter", "all_gather")
_AllToAll = _twins("_AllToAll", "all_to_all", "all_to_all_back")


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a parallel region with a replicated x: identity forward, gradients summed over the
    group."""
    return x if group is None else _apply(_CopyTo, x, group, ())


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a parallel region by summing partial results: all-reduce forward, identity backward."""
    return x if group is None else _apply(_ReduceFrom, x, group, ())


def scatter_to(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """This rank's chunk of a replicated x along dim; the backward all-gathers."""
    return x if group is None else _apply(_ScatterTo, x, group, (dim,))


def gather_from(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' chunks along dim into a replicated tensor; the backward keeps our
    chunk."""
    return x if group is None else _apply(_GatherFrom, x, group, (dim,))


def gather_from_sp(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sequence parallel -> tensor parallel: all-gather along the sequence dim; the backward
    reduce-scatters, because each rank's consumer produced a partial gradient of the whole
    sequence."""
    return x if group is None else _apply(_GatherFromSP, x, group, (dim,))


def reduce_scatter_to(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Tensor parallel -> sequence parallel: sum partial results and keep this rank's sequence
    chunk."""
    return x if group is None else _apply(_ReduceScatterTo, x, group, (dim,))


def all_to_all(x: torch.Tensor, group: Group, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Chunk j of x (along split_dim) goes to rank j; received chunks are concatenated along
    cat_dim."""
    return x if group is None else _apply(_AllToAll, x, group, (split_dim, cat_dim))


class _AllToAllRows(torch.autograd.Function):
    """Rows of x go to the ranks by the counts `send` and arrive by `recv` (host lists every pair
    agrees on): linear, so its jvp moves the tangent the same way and its backward moves the
    gradient back. Eager only: the counts are host values, which a compiled graph cannot take."""

    @staticmethod
    def forward(x, group, send, recv):
        return group.all_to_all_rows(x, send, recv)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.send, ctx.recv = inputs

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_to_all_rows(grad, ctx.recv, ctx.send), None, None, None

    @staticmethod
    def jvp(ctx, x_t, _group_t, _send_t, _recv_t):
        return ctx.group.all_to_all_rows(x_t, ctx.send, ctx.recv)

    @staticmethod
    def vmap(info, in_dims, x, group, send, recv):
        if in_dims[0] is None:
            return _AllToAllRows.apply(x, group, send, recv), None
        # rows stay first
        return _AllToAllRows.apply(x.movedim(in_dims[0], 1), group, send, recv), 1


def all_to_all_rows(
    x: torch.Tensor, group: Group, send: list[int], recv: list[int]
) -> torch.Tensor:
    """Uneven all-to-all along the rows (dim 0): the next send[j] rows go to rank j; the result
    holds the recv[j] rows from each rank j, in rank order. The backward sends gradients back the
    same way."""
    if group is None:
        return x
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "all_to_all_rows takes host counts, which a compiled graph cannot: run it eagerly"
        )
    return _AllToAllRows.apply(x, group, list(send), list(recv))


class _Constant(torch.autograd.Function):
    """A collective whose result is treated as a constant (maxima for numerical shifts that cancel,
    counts, routing choices): no gradient flows through it. op: "max" or "sum" (all-reduce) or
    "gather" (all-gather along dim)."""

    @staticmethod
    def forward(x, group, op, dim):
        return group.all_gather(x, dim) if op == "gather" else group.all_reduce(x, op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.op, ctx.dim = inputs
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None

    @staticmethod
    def jvp(ctx, x_t, _group_t, _op_t, _dim_t):
        if ctx.op != "gather":
            return torch.zeros_like(x_t)
        shape = list(x_t.shape)
        shape[ctx.dim] *= ctx.group.size
        return x_t.new_zeros(shape)

    @staticmethod
    def vmap(info, in_dims, x, group, op, dim):
        if in_dims[0] is None:
            return _Constant.apply(x, group, op, dim), None
        x = x.movedim(in_dims[0], 0)
        return _Constant.apply(x, group, op, dim % (x.dim() - 1) + 1 if op == "gather" else dim), 0


def _constant(x: torch.Tensor, group: Group, op: str, dim: int = 0) -> torch.Tensor:
    if group is None:
        return x.detach()
    # no gradient flows, so no Function is needed (nor traced)
    if torch.compiler.is_compiling():
        x = x.detach()
        return group.all_gather(x, dim) if op == "gather" else group.all_reduce(x, op)
    return _Constant.apply(x.detach(), group, op, dim)


def all_reduce_max_constant(x: torch.Tensor, group: Group) -> torch.Tensor:
    """max over the group of x, with no gradient (the caller's result must not depend on it)."""
    return _constant(x, group, "max")


def all_reduce_constant(x: torch.Tensor, group: Group) -> torch.Tensor:
    """sum over the group of x, with no gradient (counts, statistics)."""
    return _constant(x, group, "sum")


def all_gather_constant(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """every rank's x concatenated along dim, with no gradient (integer choices such as routed
    experts)."""
    return _constant(x, group, "gather", dim)
