"""Sharded programs for fmeg.testing's own tests: correct ones, and copies with one planted bug
each (module level, so gloo ranks can import them)."""

from __future__ import annotations

import torch

from fmeg.parallel import collectives as C
from fmeg.parallel.tensor import (
    TensorParallel,
    column_parallel_linear,
    row_parallel_linear,
    vocab_parallel_embedding,
)


def mlp_reference(p, x):
    h = torch.tanh(x @ p["fc1"]["weight"].T + p["fc1"]["bias"])
    return h @ p["fc2"]["weight"].T + p["fc2"]["bias"]


def mlp_sharded(mesh, p, x):
    """Megatron's MLP: column-parallel fc1, row-parallel fc2."""
    tp = TensorParallel(mesh.group("tp"), mesh.sequence_parallel)
    h = torch.tanh(column_parallel_linear(x, p["fc1"]["weight"], p["fc1"]["bias"], tp))
    return row_parallel_linear(h, p["fc2"]["weight"], p["fc2"]["bias"], tp)


class _ReduceForwardOnly(torch.autograd.Function):
    """The planted bug: the region's exit all-reduces forward, but the entry's backward
    all-reduce is missing (x's gradient stays each rank's partial sum)."""

    @staticmethod
    def forward(x, group):
        return group.all_reduce(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None

    @staticmethod
    def jvp(ctx, x_t, _):
        return x_t

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _ReduceForwardOnly.apply(x, group), in_dims[0]


def mlp_missing_backward_all_reduce(mesh, p, x):
    """mlp_sharded with x entering the parallel region by a plain identity (no copy_to): the
    forward is right, x's gradient is not."""
    g = mesh.group("tp")
    h = torch.tanh(x @ p["fc1"]["weight"].T + p["fc1"]["bias"])
    return _ReduceForwardOnly.apply(h @ p["fc2"]["weight"].T, g) + p["fc2"]["bias"]


class _GatherWrongVmap(torch.autograd.Function):
    """All-gather along dim, its vmap rule forgetting to shift dim past the batch dimension."""

    @staticmethod
    def forward(x, group, dim):
        return group.all_gather(x, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim = inputs

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size, dim=ctx.dim)[ctx.group.rank], None, None

    @staticmethod
    def jvp(ctx, x_t, _group, _dim):
        return ctx.group.all_gather(x_t, ctx.dim)

    @staticmethod
    def vmap(info, in_dims, x, group, dim):
        x = x.movedim(in_dims[0], 0)
        return _GatherWrongVmap.apply(x, group, dim), 0


def rows_reference(p, x):
    return torch.tanh(x * p["w"])


def rows_sharded(mesh, p, x):
    """Each rank scales its rows of x (dim 0) and the rows are gathered back."""
    g = mesh.group("tp")
    mine = C.scatter_to(x, g, 0)
    return C.gather_from(torch.tanh(mine * p["w"]), g, 0)


def rows_wrong_vmap(mesh, p, x):
    """rows_sharded with a gather whose vmap rule is wrong."""
    g = mesh.group("tp")
    mine = C.scatter_to(x, g, 0)
    return _GatherWrongVmap.apply(torch.tanh(mine * p["w"]), g, 0)


def embedding_reference(p, ids):
    return p["weight"][ids]


def embedding_sharded(mesh, p, ids):
    return vocab_parallel_embedding(ids, p["weight"], TensorParallel(mesh.group("tp")))
