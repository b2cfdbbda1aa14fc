"""How the experts' tokens travel (fmeg.models.moe's dispatchers, Megatron's token dispatchers).

allgather: the tokens, their experts and their weights are all-gathered over the dispatch group (tp
under sequence parallelism, times ep), every rank runs its F-slice of its experts on all of them,
and a reduce-scatter returns each rank the sum for its own tokens; without sequence parallelism
every tp rank holds all the tokens and the F-slices' partial sums are all-reduced. alltoall: each
assignment travels to its expert's rank and back by an uneven all-to-all (its counts are host
values, so compiled graphs take allgather, which computes the same numbers).
"""

from __future__ import annotations

from typing import Any

import torch

from fmeg.fp8.grouped import EXPERT_RECIPES, fp8_grouped_linear
from fmeg.ops import moe as moe_ops
from fmeg.parallel import collectives as C
from fmeg.parallel.tensor import SEQ_DIM, TensorParallel

Params = dict[str, Any]


def dispatch_groups(tp: TensorParallel) -> tuple[bool, Any, tuple]:
    """(every tp rank holds all the tokens?, the group tokens are dispatched over or None, the
    experts' (tp group, rank, size)); a ValueError for layouts Megatron-core does not run."""
    ep = tp.experts
    # every tp rank holds (and routes) all the tokens
    replicated = tp.size > 1 and not tp.sp
    if replicated and ep.size > 1:
        raise ValueError(
            "expert parallelism with tensor parallelism needs sequence parallelism "
            "(--sequence-parallel), as in Megatron-core"
        )
    if replicated and ep.tp_size not in (None, tp.size):
        raise ValueError("an expert tensor-parallel size other than tp needs sequence parallelism")
    # tokens move over the experts' tp x ep group (by default, tp's under sequence parallelism)
    if replicated:
        dispatch = None
    elif ep.tp_size is not None or ep.size > 1:
        dispatch = ep.group
    else:
        dispatch = tp.group if tp.sp else None
    if ep.tp_size is None:
        return replicated, dispatch, (tp.group, tp.rank, tp.size)
    return replicated, dispatch, (ep.tp_group, ep.tp_rank, ep.tp_size)


def fp8_experts(tp: TensorParallel, expert_tp: tuple):
    """expert_rows' grouped(site, rows, weight, counts, expert_of_row, source_of_row) for this
    layer's FP8 recipe (fmeg.fp8.grouped), or None (the compute dtype)."""
    if tp.fp8 is None or tp.fp8.recipe.recipe not in EXPERT_RECIPES:
        return None
    ep, fp8 = tp.experts, tp.fp8

    def grouped(site, rows, weight, counts, expert_of_row, source_of_row):
        held = weight.shape[0]
        spec = fp8.experts(
            site, ep.rank * held, held, ep.num_sources, (ep.amax_group,), (expert_tp[0],)
        )
        return fp8_grouped_linear(rows, weight, counts, expert_of_row, source_of_row, spec)

    return grouped


def _sources(ep, members: int, device) -> torch.Tensor:
    """The microbatch id of each of the dispatch group's members."""
    ids = ep.sources if len(ep.sources) == members else (ep.microbatch,) * members
    return torch.tensor(ids, device=device)


def allgather_experts(
    p: Params,
    x_BSH: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    dispatch,
    ep,
    expert_tp: tuple,
    activation,
    grouped=None,
) -> torch.Tensor:
    """Megatron's allgather dispatcher: every rank's tokens gathered over the dispatch group (None:
    the tokens here, or all tokens replicated over tp without sequence parallelism), each rank's
    experts (its F-slice of them) run on all of them, and a reduce-scatter returns each rank the sum
    for its own tokens. grouped: FP8 grouped GEMMs (fp8_experts), told each token's microbatch."""
    tp_group, tp_rank, tp_size = expert_tp
    replicated = dispatch is None and tp_size > 1
    if dispatch is not None:
        x_all = C.gather_from_sp(x_BSH, dispatch, SEQ_DIM)
        probs = C.gather_from_sp(probs, dispatch, SEQ_DIM)
        experts = C.all_gather_constant(experts, dispatch, SEQ_DIM)
    # each rank's F-slice gives partial sums: their gradients are summed over tp
    elif replicated:
        x_all, probs = C.copy_to(x_BSH, tp_group), C.copy_to(probs, tp_group)
    else:
        x_all = x_BSH
    b, s, h = x_all.shape
    source = None
    if grouped is not None:
        # the gathered sequence is each dispatch member's piece in turn
        members = 1 if dispatch is None else dispatch.size
        piece = (torch.arange(b * s, device=x_all.device) % s) // (s // members)
        source = _sources(ep, members, x_all.device)[piece]
    fc1, fc2 = p["fc1"], p["fc2"]
    bias = fc2.get("bias")
    # added by one rank (the reduction sums the F-slices' partials)
    if bias is not None and tp_size > 1:
        bias = C.copy_to(bias, tp_group) * (1.0 if tp_rank == 0 else 0.0)
    y = moe_ops.expert_mlp(
        x_all.reshape(b * s, h),
        probs.reshape(b * s, -1).to(x_all.dtype),
        experts.reshape(b * s, -1),
        fc1["weight"],
        fc2["weight"],
        activation,
        fc1.get("bias"),
        bias,
        first_expert=ep.rank * fc1["weight"].shape[0],
        grouped=grouped,
        source_of_token=source,
    )
    y = y.reshape(b, s, h)
    if dispatch is not None:
        return C.reduce_scatter_to(y, dispatch, SEQ_DIM)
    return C.reduce_from(y, tp_group) if replicated else y


def alltoall_experts(
    p: Params,
    x_BSH: torch.Tensor,
    probs: torch.Tensor,
    experts: torch.Tensor,
    ep,
    activation,
    grouped=None,
) -> torch.Tensor:
    """Megatron's alltoall dispatcher (experts not split over tp): each (token, expert) assignment
    here travels to the ep rank holding its expert, by one uneven all-to-all over ep.group, and its
    expert's output comes back by the reverse one; each rank weighs and sums its own tokens'
    outputs. The counts every pair of ranks exchanges are all-gathered and read on the host first
    (one sync, as Megatron's dispatcher makes)."""
    b, s, h = x_BSH.shape
    fc1, fc2 = p["fc1"], p["fc2"]
    held, k = fc1["weight"].shape[0], experts.shape[-1]
    chosen = experts.reshape(-1)
    if ep.group is None:
        # every token here is this rank's microbatch's, and expert_mlp takes one source per token
        # (a one-member vector indexed by token fails past token 0)
        source = None if grouped is None else _sources(ep, 1, x_BSH.device).expand(b * s)
        return moe_ops.expert_mlp(
            x_BSH.reshape(b * s, h),
            probs.reshape(b * s, k).to(x_BSH.dtype),
            experts.reshape(b * s, k),
            fc1["weight"],
            fc2["weight"],
            activation,
            fc1.get("bias"),
            fc2.get("bias"),
            grouped=grouped,
            source_of_token=source,
        ).reshape(b, s, h)
    me, size = ep.rank, ep.size
    # by expert, so by the rank that holds it
    order = torch.argsort(chosen, stable=True)
    token = order // k
    counts = torch.bincount(chosen, minlength=held * size)
    # [rank][expert]: assignments made there
    table = C.all_gather_constant(counts[None], ep.group, 0).tolist()
    send = [sum(table[me][j * held : (j + 1) * held]) for j in range(size)]
    recv = [sum(table[i][me * held : (me + 1) * held]) for i in range(size)]
    rows = C.all_to_all_rows(x_BSH.reshape(b * s, h)[token], ep.group, send, recv)
    # arrived: from each rank, its rows for each of our experts in turn; regroup them by expert
    arrived = torch.tensor(
        [table[i][me * held + e] for i in range(size) for e in range(held)], device=rows.device
    )
    expert_of = torch.arange(held, device=rows.device).repeat(size).repeat_interleave(arrived)
    regroup = torch.argsort(expert_of, stable=True)
    source = _sources(ep, size, rows.device).repeat_interleave(held).repeat_interleave(arrived)
    y = moe_ops.expert_rows(
        rows[regroup],
        expert_of[regroup],
        torch.bincount(expert_of, minlength=held),
        fc1["weight"],
        fc2["weight"],
        activation,
        fc1.get("bias"),
        fc2.get("bias"),
        grouped,
        source[regroup],
    )
    y = C.all_to_all_rows(y[torch.argsort(regroup)], ep.group, recv, send)
    weight = probs.reshape(-1)[order].to(y.dtype)
    out = torch.zeros(b * s, h, dtype=y.dtype, device=y.device).index_add(
        0, token, y * weight[:, None]
    )
    return out.to(x_BSH.dtype).reshape(b, s, h)
