"""Rank programs for fmeg.parallel.exact's property tests (importable: gloo ranks run them too)."""

from fmeg.parallel.exact import fixed_point_sum, fixed_point_total


def sum_of_my_part(mesh, x, cuts, order):
    """fixed_point_sum over the tp group of rows [cuts[r], cuts[r + 1]) of x on rank r, taken in
    the order `order` gives them."""
    rank = mesh.coord("tp")
    part = x[cuts[rank] : cuts[rank + 1]]
    part = part[order[rank]] if len(order[rank]) else part
    return fixed_point_sum(part, 0, mesh.group("tp"))


def total_of_my_tensors(mesh, tensors):
    """fixed_point_total over the tp group of rank r's list tensors[r]."""
    return fixed_point_total(tensors[mesh.coord("tp")], mesh.group("tp"))


def accumulate_my_contributions(mesh, contributions, owner, order):
    """ExactAccumulator: rank r adds contributions[i] (i with owner[i] == r) in `order`, then the
    sum over the tp group."""
    from fmeg.parallel.exact import ExactAccumulator

    rank = mesh.coord("tp") if mesh is not None else 0
    acc = ExactAccumulator(contributions[0][1].numel())
    for i in order:
        if owner[i] == rank:
            start, x = contributions[i]
            acc.add_(start, x)
    acc.sum_over(mesh.group("tp") if mesh is not None else None)
    return acc.value()


def scatter_my_contributions(mesh, contributions, owner, order, units):
    """As accumulate_my_contributions, then this rank's chunks of each unit of the sum over the
    tp group (ExactAccumulator.scatter_over, FSDP's sharded gradients)."""
    from fmeg.parallel.exact import ExactAccumulator

    rank = mesh.coord("tp")
    acc = ExactAccumulator(contributions[0][1].numel())
    for i in order:
        if owner[i] == rank:
            start, x = contributions[i]
            acc.add_(start, x)
    return acc.scatter_over(mesh.group("tp"), units).value()


def exact_mlp(mesh, x, w1, b1, w2):
    """(y, the gradients of sum(y * y) for x and this rank's w1, b1, w2 slices) of
    fmeg.parallel.exact_regions' column then row linear, w1's rows [..., rows, in] and w2's
    columns [out, ..., rows] (the same features) split over the tp group. One intra-op thread:
    a GEMM's bits may depend on how many threads share it."""
    import torch

    from fmeg.parallel.exact_regions import column_linear, pieces_held, row_linear

    torch.set_num_threads(1)
    t, r = (mesh.group("tp").size, mesh.coord("tp")) if mesh.group("tp") else (1, 0)
    group = mesh.group("tp")
    x = x.detach().requires_grad_()
    w1, b1 = w1.chunk(t, -2)[r].detach().requires_grad_(), b1.chunk(t, -1)[r].detach()
    b1, w2 = b1.requires_grad_(), w2.chunk(t, -1)[r].detach().requires_grad_()
    h = torch.tanh(column_linear(x, w1, b1.flatten(), pieces_held(w1.shape[-2], t), group))
    y = row_linear(h, w2.flatten(1), pieces_held(w2.flatten(1).shape[-1], t), group)
    return (y.detach(), *torch.autograd.grad(y.square().sum(), (x, w1, b1, w2)))


def token_scaled(mesh, x, w):
    """(this rank's tokens of x times w, w's gradient of their sum of squares): the tokens (dim 0)
    split over the tp group, w applied by exact_regions.per_token."""
    import torch

    from fmeg.parallel.exact_regions import per_token

    group = mesh.group("tp")
    t, r = (group.size, mesh.coord("tp")) if group else (1, 0)
    w = w.detach().requires_grad_()
    part = x.chunk(t, 0)[r]
    y = part * per_token(w, part, group)
    return y.detach(), torch.autograd.grad(y.square().sum(), w)[0]
