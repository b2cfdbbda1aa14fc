"""Mixture-of-experts math on one device: routing, load-balancing losses, and the experts as grouped
matmuls.

    probs_TK, experts_TK = route(logits_TE, topk=2)                 # Megatron's top-k routing
    # token dropping (None: dropless)
    keep_TK = capacity_keep(probs_TK, experts_TK, E, factor=1.0)
    y_TH = expert_mlp(x_TH, probs_TK, experts_TK, fc1_EFH, fc2_EHF, activation)

Tokens are rows T of a [T, H] matrix, experts E, k experts per token. Shapes follow Megatron-core's
router (megatron/core/transformer/moe/moe_utils.py) so that its flags mean the same here:

- softmax scores: softmax over the top-k logits (Mixtral; equal to renormalising the top-k of a
  softmax over all experts), or with pre_softmax the top-k of a softmax over all experts, not
  renormalised.
- sigmoid scores (DeepSeek-V3): sigmoid of the logits; the top-k is chosen on sigmoid + expert_bias
  (the bias steers the choice only) and the chosen scores are normalised to sum to 1 when k > 1.
- group-limited routing: experts in num_groups equal groups; a token first picks group_topk groups
  by the sum of each group's top (k / group_topk) scores (megatron-core; transformers' DeepSeek-V3:
  its top 2), then its k experts inside them.
- scaling_factor multiplies the final probabilities.

Experts run as one grouped matmul per weight over the tokens sorted by expert (torch._grouped_mm
where the device and dtype take it: bf16 on CUDA 9.0+, fp32 on CPU when not compiled; a loop over
experts otherwise): no loop over tokens, and no host sync on the grouped path. The loop reads the
experts' boundaries on the host, except under torch.compile, where it runs every expert on every
row, masked (no host sync in a graph, at E times the FLOPs: compiled runs want the grouped path).
Inside ops.weight_grads.deferrable() (a zero-bubble schedule's forward) the experts' weight
gradients may be deferred to W, as the linears' are, with the same numbers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fmeg.ops.weight_grads import defer, forward_deferrable

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


def route(
    logits_TE: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    group_score_topk: int | None = None,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, k] in at least fp32, experts [T, k] int64): each token's k experts and their
    weights. group_score_topk: how many of a group's best scores rank it (None: topk // group_topk,
    megatron-core's); normalize: a sigmoid router's top-k weights divided by their sum
    (transformers' norm_topk_prob)."""
    logits = _at_least_fp32(logits_TE)
    per_group = group_score_topk or (topk // group_topk if group_topk else None)

    def top(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if group_topk:
            scores = _mask_to_groups(scores, per_group, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=-1)

    if score_function == "softmax":
        if pre_softmax:
            probs, experts = top(torch.softmax(logits, dim=-1))
        else:
            chosen, experts = top(logits)
            probs = torch.softmax(chosen, dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, experts = top(scores + expert_bias.to(scores.dtype))
            probs = scores.gather(-1, experts)
        else:
            probs, experts = top(scores)
        if topk > 1 and normalize:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    return probs, experts


def _mask_to_groups(
    scores_TE: torch.Tensor, per_group: int, num_groups: int, group_topk: int
) -> torch.Tensor:
    """scores with -inf outside each token's group_topk best groups (ranked by the sum of their
    per_group best)."""
    t, e = scores_TE.shape
    grouped = scores_TE.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(per_group, dim=-1).values.sum(dim=-1)
    chosen = torch.topk(group_scores, k=group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    return scores_TE.masked_fill(~allowed.repeat_interleave(e // num_groups, dim=1), float("-inf"))


def routing_map(experts_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] float: 1 where a token is routed to an expert."""
    return torch.zeros(experts_TK.shape[0], num_experts, device=experts_TK.device).scatter(
        1, experts_TK, 1.0
    )


def aux_scores(
    logits_TE: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E], routing map [T, E]) that the load-balancing losses use: every expert's
    normalised score (softmax, or sigmoid divided by its sum) and the plain top-k of those scores
    (no bias, no groups)."""
    logits = _at_least_fp32(logits_TE)
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, routing_map(torch.topk(scores, k=topk, dim=-1).indices, logits.shape[-1])


def switch_aux_loss(
    scores_TE: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_tokens: int | torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """Switch Transformer's balance loss E * sum_i f_i * P_i (uniform routing gives 1): f_i the
    fraction of the total_tokens * topk assignments that went to expert i (tokens_per_expert:
    counted over all of them), P_i the mean score of expert i. scores may be this rank's part of the
    tokens: the losses of the parts sum to the loss of the whole."""
    e = scores_TE.shape[-1]
    return (scores_TE.sum(dim=0) * tokens_per_expert).sum() * (
        e / (topk * total_tokens * total_tokens)
    )


def sequence_aux_loss(
    scores_BSE: torch.Tensor,
    map_BSE: torch.Tensor,
    topk: int,
    tokens_per_sequence: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek's sequence-level balance loss: the switch loss of each sequence, averaged over
    sequences. tokens_per_sequence: the tokens a sequence counts (default its length; with padding,
    megatron-core's mean of the sequences' unpadded tokens, the padded ones' scores and choices
    being zero)."""
    _, s, e = scores_BSE.shape
    count = s if tokens_per_sequence is None else tokens_per_sequence
    fraction = map_BSE.sum(dim=1) * (e / (count * topk))
    return (fraction * scores_BSE.sum(dim=1) / count).sum(dim=-1).mean()


def z_loss(logits_TE: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits) squared (over the valid ones: 1
    / 0 each)."""
    z = torch.logsumexp(_at_least_fp32(logits_TE), dim=-1).square()
    return z.mean() if valid_T is None else (z * valid_T).sum() / valid_T.sum().clamp(min=1.0)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Megatron's expert capacity: ceil(tokens * topk / experts * factor), tokens being those routed
    together."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def capacity_keep(
    probs_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    num_experts: int,
    factor: float,
    policy: str = "probs",
) -> torch.Tensor:
    """[T, k] bool: which assignments survive each expert's capacity (Megatron's token dropping).
    "probs" keeps each expert's highest-probability tokens; "position" is megatron-core's:
    torch.topk over the 0/1 routing map, so among an expert's tokens it keeps those topk returns for
    equal values (not necessarily the first ones: on CPU often later ones), and the same ones as
    megatron-core's router on a device."""
    t, k = experts_TK.shape
    cap = capacity(t, num_experts, k, factor)
    if cap >= t:
        return torch.ones_like(experts_TK, dtype=torch.bool)
    # [T, E]
    onehot = routing_map(experts_TK, num_experts).bool()
    if policy == "probs":
        dense = torch.zeros(t, num_experts, device=probs_TK.device).scatter(
            1, experts_TK, probs_TK.detach().float()
        )
        dense = dense.masked_fill(~onehot, -1.0)
        kept = (
            torch.zeros_like(onehot).scatter(0, torch.topk(dense, k=cap, dim=0).indices, True)
            & onehot
        )
    elif policy == "position":
        kept = (
            torch.zeros_like(onehot).scatter(
                0, torch.topk(onehot.int(), k=cap, dim=0, sorted=False).indices, True
            )
            & onehot
        )
    else:
        raise ValueError(f"drop policy must be one of {DROP_POLICIES}, got {policy!r}")
    return kept.gather(1, experts_TK)


def expert_mlp(
    x_TH: torch.Tensor,
    probs_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    activation,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    first_expert: int = 0,
    grouped=None,
    source_of_token: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over each token's k experts of prob * fc2(act(fc1(x))) -> [T, H], for the experts held in
    the weights (fc1 [E', F, H] or [E', 2, F, H] for gated, fc2 [E', H, F]; E' experts numbered from
    first_expert); assignments to other experts contribute nothing. activation(h [.., F] or [..,
    2F]) -> [.., F]. grouped, source_of_token: as expert_rows takes them, per token."""
    held = fc1.shape[0]
    local = experts_TK - first_expert
    mine = (local >= 0) & (local < held)
    # every assignment sorted by its expert (others last), so each expert's tokens are one
    # contiguous block
    key = torch.where(mine, local, held).flatten()
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=held + 1)[:held]
    token = order // experts_TK.shape[1]
    source = None if source_of_token is None else source_of_token[token]
    y = expert_rows(
        x_TH[token], key[order], counts, fc1, fc2, activation, fc1_bias, fc2_bias, grouped, source
    )
    weight = (probs_TK * mine).flatten()[order].to(y.dtype)
    return (
        torch.zeros_like(x_TH, dtype=y.dtype)
        .index_add(0, token, y * weight[:, None])
        .to(x_TH.dtype)
    )


def expert_rows(
    rows_NH: torch.Tensor,
    expert_of_row: torch.Tensor,
    counts_E: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    activation,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    grouped=None,
    source_of_row: torch.Tensor | None = None,
) -> torch.Tensor:
    """fc2(act(fc1(row))) of each row's expert -> [N, H], for rows sorted by expert (expert_of_row;
    rows after the counts' blocks belong to none of the E' experts held and give zeros, their
    expert_of_row E'). grouped(site, rows, weight, counts, expert_of_row, source_of_row) replaces
    grouped_linear (site: "fc1" or "fc2"; fmeg.fp8.grouped's FP8 GEMMs), source_of_row: each
    row's microbatch id (None: 0 for all)."""
    held = fc1.shape[0]
    if grouped is None:
        linear = lambda site, rows, w: grouped_linear(rows, w, counts_E)  # noqa: E731
    else:
        source = expert_of_row.new_zeros(()) if source_of_row is None else source_of_row
        source = source.expand_as(expert_of_row)
        linear = lambda site, rows, w: grouped(  # noqa: E731
            site, rows, w, counts_E, expert_of_row, source
        )
    h = linear("fc1", rows_NH, fc1)
    if fc1_bias is not None:
        h = h + _per_row(fc1_bias.flatten(1), expert_of_row, held)
    h = activation(h)
    y = linear("fc2", h, fc2)
    if fc2_bias is not None:
        y = y + _per_row(fc2_bias, expert_of_row, held)
    return y


def _per_row(bias_EF: torch.Tensor, expert_of_row: torch.Tensor, held: int) -> torch.Tensor:
    """Each sorted row's expert's bias (zero for rows of other experts)."""
    padded = torch.cat([bias_EF, bias_EF.new_zeros(1, bias_EF.shape[-1])])
    return padded[expert_of_row.clamp(max=held)]


def grouped_linear(
    rows_NH: torch.Tensor, weight_EFH: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """rows sorted by expert (the first counts[0] rows are expert 0's, ...; any rows after them
    belong to no expert and give zeros) times each expert's weight transposed -> [N, F]. A gated
    weight [E, 2, F, H] (gate rows, then up rows) is read as [E, 2F, H]."""
    if forward_deferrable():
        return DeferrableGroupedLinear.apply(rows_NH, weight_EFH, counts_E)
    return grouped_matmul(rows_NH, _flat(weight_EFH), counts_E)


def _flat(weight: torch.Tensor) -> torch.Tensor:
    return weight.flatten(1, -2) if weight.dim() == 4 else weight


def grouped_matmul(
    rows_NH: torch.Tensor, weight_EFH: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """grouped_linear's product for a flat weight [E, F, H], without a deferrable weight gradient
    (fmeg.fp8.grouped multiplies its dequantized operands with it)."""
    n, e = rows_NH.shape[0], weight_EFH.shape[0]
    # an expert-parallel shard can hold none of a small model's experts
    if e == 0:
        return rows_NH.new_zeros(n, weight_EFH.shape[-2]) + 0 * weight_EFH.sum()
    ends = counts_E.cumsum(0)
    if _grouped_mm_supported(rows_NH, weight_EFH):
        offs = ends.to(torch.int32)
        # the kernel leaves rows past the last expert's block undefined, in its output and in its
        # input's gradient: select zeros for them on both sides
        valid = (torch.arange(n, device=rows_NH.device) < ends[-1])[:, None]
        rows_NH = torch.where(valid, rows_NH, rows_NH.new_zeros(()))
        out = torch._grouped_mm(rows_NH, weight_EFH.transpose(-1, -2), offs=offs)
        return torch.where(valid, out, out.new_zeros(()))
    # no host sync inside a graph: every expert on every row, masked
    if torch.compiler.is_compiling():
        starts = ends - counts_E
        position = torch.arange(n, device=rows_NH.device)
        out = rows_NH.new_zeros(n, weight_EFH.shape[-2])
        for i in range(e):
            mine = ((position >= starts[i]) & (position < ends[i]))[:, None]
            out = out + torch.where(
                mine, rows_NH @ weight_EFH[i].transpose(-1, -2), out.new_zeros(())
            )
        return out
    # the fallback: one matmul per expert (a host sync for the boundaries)
    bounds = [0, *ends.tolist()]
    parts = [rows_NH[bounds[i] : bounds[i + 1]] @ weight_EFH[i].transpose(-1, -2) for i in range(e)]
    rest = rows_NH.new_zeros(n - bounds[-1], weight_EFH.shape[-2])
    return torch.cat([*parts, rest])


def grouped_weight_grad(
    grad_NF: torch.Tensor, rows_NH: torch.Tensor, counts_E: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    """Each expert's weight gradient [E, F, H]: its rows' grad.T @ rows, as autograd computes it
    for grouped_matmul (the same kernel, so the same bits)."""
    if shape[0] == 0:
        return grad_NF.new_zeros(shape)
    ends = counts_E.cumsum(0)
    if _grouped_mm_supported(rows_NH, grad_NF.new_empty(shape)):
        valid = (torch.arange(rows_NH.shape[0], device=rows_NH.device) < ends[-1])[:, None]
        zero = rows_NH.new_zeros(())
        grad_NF, rows_NH = torch.where(valid, grad_NF, zero), torch.where(valid, rows_NH, zero)
        return torch._grouped_mm(grad_NF.t(), rows_NH, offs=ends.to(torch.int32))
    bounds = [0, *ends.tolist()]
    return torch.stack([grad_NF[a:b].t() @ rows_NH[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


class DeferrableGroupedLinear(torch.autograd.Function):
    """grouped_linear whose weight gradient may be deferred (ops.weight_grads): the rows' gradient
    in backward, the weight's in W."""

    @staticmethod
    def forward(rows, weight, counts):
        return grouped_matmul(rows, _flat(weight), counts)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, counts = ctx.saved_tensors
        w = _flat(weight)
        drows = grouped_matmul(grad, w.transpose(-1, -2), counts)
        dw = None
        if ctx.needs_input_grad[1]:

            def compute(grad=grad, rows=rows) -> torch.Tensor:
                return grouped_weight_grad(grad, rows, counts, w.shape).reshape(weight.shape)

            if not defer(weight, compute):
                dw = compute()
        return drows, dw, None


def _grouped_mm_supported(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype:
        return False
    # the kernel wants 16-byte strides
    aligned = 16 // rows.element_size()
    if rows.shape[-1] % aligned or weight.shape[-2] % aligned:
        return False
    if rows.device.type == "cuda":
        return rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (
            9,
            0,
        )
    # the CPU kernel takes fp32, but torch.compile's shape function only bf16
    return (
        rows.device.type == "cpu"
        and rows.dtype == torch.float32
        and not torch.compiler.is_compiling()
    )


def reference_moe(
    x_TH: torch.Tensor,
    probs_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    activation,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain definition, for tests: a loop over experts, each applied to every token, masked."""
    out = torch.zeros_like(x_TH)
    for e in range(fc1.shape[0]):
        w1 = fc1[e].flatten(0, -2)
        b1 = None if fc1_bias is None else fc1_bias[e].flatten()
        y = F.linear(
            activation(F.linear(x_TH, w1, b1)), fc2[e], None if fc2_bias is None else fc2_bias[e]
        )
        weight = (probs_TK * (experts_TK == e)).sum(dim=-1, keepdim=True)
        out = out + weight * y
    return out
