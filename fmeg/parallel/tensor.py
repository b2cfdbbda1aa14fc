"""Tensor and sequence parallelism as pure functions of local shards.

A TensorParallel value names the group and whether sequence parallelism is on. Shapes below are for
one rank of a group of size t; activations are [batch, seq, hidden] and the sequence dimension is 1.

    column_parallel_linear   x [b, s, h] (or [b, s/t, h] with SP) , w [out/t, in] -> y [b, s, out/t]
    row_parallel_linear
        x [b, s, in/t], w [out, in/t], bias [out] -> y [b, s, out] (or [b, s/t, out])
    vocab_parallel_embedding ids [b, s], table [V/t, h] -> [b, s, h] (or [b, s/t, h])
    vocab_parallel_cross_entropy
        logits [b, s, V/t], labels [b, s] -> per-token loss [b, s], replicated

The vocabulary may be padded (V = padded size, Megatron's multiple of 128 * t): ids at or above the
real vocab_size are masked out of every softmax (mask_vocab_padding), so the padding changes no
number.

With group None every function is its single-device counterpart. Gradients of a replicated parameter
used on a sequence shard (norm weights, row-parallel biases, position embeddings) are partial on
each rank; `replicated_param` routes such a parameter through copy_to so its gradient arrives
already summed over the group, the all-reduce Megatron performs for sequence-parallel parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fmeg import ops
from fmeg.fp8.linear import fp8_linear
from fmeg.ops.precision import upcast
from fmeg.parallel import collectives as C
from fmeg.parallel import exact_regions
from fmeg.parallel.context import NO_CP, ContextParallel
from fmeg.parallel.context import positions as context_positions

SEQ_DIM = 1


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism seen from one rank: its index and the number of expert-parallel ranks
    (each holds num_experts / size experts), and the group a mixture-of-experts layer exchanges its
    tokens over: the expert-parallel ranks times the experts' tensor-parallel ones (megatron-core's
    tp_ep group of the expert grid), or None when tokens need no exchange."""

    group: Any = None
    rank: int = 0
    size: int = 1
    # the experts' tensor parallelism (each expert's F split), when tp_size is given
    tp_group: Any = None
    tp_rank: int = 0
    # None: the experts split their F over tp, and tokens move over tp x ep
    tp_size: int | None = None
    # the ranks whose tokens global_aux_loss counts (megatron-core's tp-dp-cp group)
    balance_group: Any = None
    # for FP8 experts (fmeg.fp8.grouped): the microbatch (data-parallel index) of each rank that
    # tokens are dispatched over (group's, or tp's when the experts are not laid out apart; ()
    # reads as one microbatch), this rank's, how many there are, and the ranks holding the same
    # experts whose amaxes join when one microbatch's rows for an expert reach several of them
    sources: tuple[int, ...] = ()
    microbatch: int = 0
    num_sources: int = 1
    amax_group: Any = None


NO_EP = ExpertParallel()


@dataclass(frozen=True)
class TensorParallel:
    # a fmeg.parallel.comm Group, or None for one rank
    group: Any = None
    sequence_parallel: bool = False
    # where mixture-of-experts layers find their experts' ranks
    experts: ExpertParallel = NO_EP
    # the sequence split over context-parallel ranks (fmeg.parallel.context)
    context: ContextParallel = NO_CP
    # the run's fmeg.fp8.plan.Fp8Plan, or None; for_layer turns it into `fp8` for its layer
    fp8_plan: Any = None
    # this layer's fmeg.fp8.plan.Fp8Layer (its linears' GEMMs in FP8), or None
    fp8: Any = None
    # --deterministic-mode: the sums tp splits taken as fixed pieces, summed exactly
    # (fmeg.parallel.exact_regions), at tp 1 too, so that every tp gives one rank's bits
    exact: bool = False

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    def __post_init__(self):
        # the layers' views are made here, outside any compiled region (dynamo cannot build this
        # class inside one on every torch version): none where no layer differs, one that every
        # layer shares where nothing depends on the index, else one per layer
        object.__setattr__(self, "_views", _layer_views(self))

    def for_layer(self, index: int) -> TensorParallel:
        """What layer `index` runs with: context parallelism's comm type of that layer, and FP8
        where the plan puts it."""
        views = self._views
        if views is None or isinstance(views, TensorParallel):
            return views or self
        view = views.get(index)
        return view if view is not None else _layer_view(self, index)

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.group is not None

    @property
    def exact_sums(self) -> bool:
        """Whether this layer's linears, norms and vocabulary sums run exactly (not yet with FP8,
        whose sums are the default mode's)."""
        return self.exact and self.fp8 is None


def _layer_view(tp: TensorParallel, index: int) -> TensorParallel:
    context = tp.context.for_layer(index)
    fp8 = tp.fp8_plan.layer(index) if tp.fp8_plan else tp.fp8
    if context is tp.context and fp8 == tp.fp8:
        return tp
    return dataclasses.replace(tp, context=context, fp8=fp8, fp8_plan=None)


def _layer_views(tp: TensorParallel) -> TensorParallel | dict | None:
    """None (every layer runs with tp), one view for all layers, or {index: view} (the decoder's
    layers and a few multi-token prediction layers past them; others are made on demand)."""
    plan = tp.fp8_plan
    per_layer_comm = not isinstance(tp.context.comm_type, str)
    if not per_layer_comm and plan is None:
        return None
    if not per_layer_comm and plan.uniform:
        return dataclasses.replace(tp, fp8=plan.layer(0), fp8_plan=None)
    layers = plan.num_layers if plan else 0
    count = max(layers, len(tp.context.comm_type) if per_layer_comm else 0) + 8
    return {i: _layer_view(tp, i) for i in range(count)}


NO_TP = TensorParallel()


def token_positions(s_held: int, tp: TensorParallel, device: Any) -> tuple[torch.Tensor, int]:
    """(the global positions of the s_held sequence rows this rank holds, the whole sequence's
    length), under context parallelism (its chunks) and sequence parallelism (tp's piece of
    them)."""
    cp = tp.context
    local = s_held * (tp.size if tp.sp else 1)
    held = context_positions(local * cp.size, cp.size, cp.rank, device)
    return (held.chunk(tp.size)[tp.rank] if tp.sp else held), local * cp.size


def hidden_dropout(x_BSH: torch.Tensor, p: float, key: Any, tp: TensorParallel) -> torch.Tensor:
    """Dropout of activations keyed by each element's position in the whole [b, s, h] tensor, so the
    mask is one device's whatever the sequence sharding (sequence and context parallelism)."""
    if p == 0.0:
        return x_BSH
    index = None
    if tp.sp or tp.context.size > 1:
        b, s, h = x_BSH.shape
        held, whole = token_positions(s, tp, x_BSH.device)
        rows = torch.arange(b, device=x_BSH.device)[:, None] * whole + held
        index = rows[:, :, None] * h + torch.arange(h, device=x_BSH.device)
    return ops.dropout(x_BSH, p, key, index=index)


def replicated_param(p: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor | None:
    """A replicated parameter used on sequence-sharded activations: gradient summed over tp."""
    return C.copy_to(p, tp.group) if p is not None and tp.sp else p


def enter(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Replicated (or sequence-sharded) activations -> the input of column-parallel work."""
    return C.gather_from_sp(x, tp.group, SEQ_DIM) if tp.sp else C.copy_to(x, tp.group)


def leave(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Partial sums from row-parallel work -> replicated (or sequence-sharded) activations."""
    return C.reduce_scatter_to(x, tp.group, SEQ_DIM) if tp.sp else C.reduce_from(x, tp.group)


def _linear(
    x, weight, bias, tp: TensorParallel, x_split: bool, y_split: bool, site: str
) -> torch.Tensor:
    """ops.linear, or under tp.fp8 the FP8 linear (site: which of the layer's linears, for delayed
    scaling's state): tensor-wise amaxes reduced over tp where the operand's features are split
    (the weight always; x in row-parallel, the output gradient in column-parallel) and over cp,
    whose ranks split the tokens."""
    if tp.fp8 is None:
        return ops.linear(x, weight, bias)
    cp = (tp.context.group,) if tp.context.size > 1 else ()
    split = lambda yes: ((tp.group,) if yes else ()) + cp  # noqa: E731
    gemms = tp.fp8.gemms(site, split(x_split), (tp.group,), split(y_split))
    return fp8_linear(x, weight, bias, gemms)


def column_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tp: TensorParallel,
    *,
    gather_output: bool = False,
    site: str = "",
    vocab: bool = False,
) -> torch.Tensor:
    """y = x @ w.T + b for this rank's rows of w (output features); optionally gathered to all.
    site: which of a layer's linears (fmeg.fp8.delayed.SITES), for FP8; vocab: w's rows are the
    padded vocabulary's (exact sums cut them in pieces of fixed size)."""
    if tp.exact_sums:
        rows = weight.shape[-2]
        n = exact_regions.pieces_held(rows, tp.size, exact_regions.VOCAB_ROWS if vocab else None)
        # the whole sequence on every rank; its gradient's sum over ranks is exact_copy's
        x = C.gather_from(x, tp.group, SEQ_DIM) if tp.sp else x
        y = exact_regions.column_linear(x, weight, bias, n, tp.group)
    else:
        y = _linear(enter(x, tp), weight, bias, tp, x_split=False, y_split=True, site=site)
    return C.gather_from(y, tp.group, -1) if gather_output else y


def row_parallel_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tp: TensorParallel,
    *,
    input_is_parallel: bool = True,
    site: str = "",
) -> torch.Tensor:
    """y = sum over ranks of x_r @ w_r.T, then + b (b is replicated and added once, after the
    reduction)."""
    if not input_is_parallel:
        x = C.scatter_to(x, tp.group, -1)
    if tp.exact_sums:
        n = exact_regions.pieces_held(weight.shape[-1], tp.size)
        y = exact_regions.row_linear(x, weight, n, tp.group)
        # the whole sum on every rank; each keeps its sequence chunk
        y = C.scatter_to(y, tp.group, SEQ_DIM) if tp.sp else y
        bias = (
            None if bias is None else exact_regions.per_token(bias, y, tp.group if tp.sp else None)
        )
        return y if bias is None else y + bias
    y = leave(_linear(x, weight, None, tp, x_split=True, y_split=False, site=site), tp)
    return y if bias is None else y + replicated_param(bias, tp)


def vocab_range(vocab_shard: int, tp: TensorParallel) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this rank owns."""
    return tp.rank * vocab_shard, (tp.rank + 1) * vocab_shard


def vocab_parallel_embedding(
    ids: torch.Tensor, table: torch.Tensor, tp: TensorParallel
) -> torch.Tensor:
    """Rows of a vocabulary-sharded table: ids outside this rank's range give zeros, then the ranks
    sum."""
    if tp.group is None:
        return ops.embedding(ids, table)
    start, end = vocab_range(table.shape[0], tp)
    outside = (ids < start) | (ids >= end)
    local = ops.embedding(torch.where(outside, 0, ids - start), table)
    local = local * (~outside).unsqueeze(-1).to(local.dtype)
    return leave(local, tp)


def vocab_padding(
    vocab_shard: int, vocab_size: int | None, tp: TensorParallel, device: Any
) -> torch.Tensor | None:
    """[vocab_shard] bool, True at this rank's padding ids (global id >= vocab_size); None if it has
    none."""
    start, end = vocab_range(vocab_shard, tp)
    if vocab_size is None or vocab_size >= end:
        return None
    return torch.arange(start, end, device=device) >= vocab_size


def mask_vocab_padding(
    logits: torch.Tensor, vocab_size: int | None, tp: TensorParallel
) -> torch.Tensor:
    """logits [..., V/t] with -inf at padding ids: no probability there and no gradient to them."""
    padding = vocab_padding(logits.shape[-1], vocab_size, tp, logits.device)
    return logits if padding is None else logits.masked_fill(padding, float("-inf"))


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp: TensorParallel,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = ops.IGNORE_INDEX,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-sharded logits, equal to ops.token_cross_entropy of the
    gathered logits' first vocab_size columns (all of them when None): padding ids take no part, and
    label smoothing is exact (the mean over the whole real vocabulary, not the shard).

    Built from differentiable collectives, so grad, jvp and vmap follow from theirs.
    """
    logits = upcast(logits)
    vocab_shard = logits.shape[-1]
    start, end = vocab_range(vocab_shard, tp)
    padding = vocab_padding(vocab_shard, vocab_size, tp, logits.device)
    if padding is not None:
        logits = logits.masked_fill(padding, float("-inf"))
    shift = C.all_reduce_max_constant(logits.max(dim=-1).values, tp.group)
    shifted = logits - shift.unsqueeze(-1)
    vocab_sum = _vocab_sum(tp)
    lse = torch.log(vocab_sum(shifted.exp()))
    in_shard = (labels >= start) & (labels < end)
    local_label = torch.where(in_shard, labels - start, 0).unsqueeze(-1)
    target = torch.where(in_shard, shifted.gather(-1, local_label).squeeze(-1), 0.0)
    nll = lse - C.reduce_from(target, tp.group)
    if label_smoothing:
        real = shifted if padding is None else shifted.masked_fill(padding, 0.0)
        mean_logit = vocab_sum(real) / (vocab_size or vocab_shard * tp.size)
        nll = (1.0 - label_smoothing) * nll + label_smoothing * (lse - mean_logit)
    return torch.where(labels == ignore_index, 0.0, nll)


def _vocab_sum(tp: TensorParallel) -> Any:
    """x [..., V/t] -> the sum over the whole vocabulary [...]: exact under exact sums (each
    vocabulary entry a piece), else each rank's float sum, then the ranks'."""
    if tp.exact and tp.fp8 is None:
        return lambda x: exact_regions.exact_reduce(x.movedim(-1, 0), tp.group)
    return lambda x: C.reduce_from(x.sum(-1), tp.group)
