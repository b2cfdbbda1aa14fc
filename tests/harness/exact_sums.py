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
