"""The mixture-of-experts MLP of a GPT layer, as pure functions over its parameters.

Parameter paths (in place of the dense layer's mlp):

    layers.{i}.mlp.router.weight              [E, H]              replicated
    layers.{i}.mlp.experts.fc1.{weight,bias}
        [E, F, H] or [E, 2, F, H] (gate, up), bias [E, F] / [E, 2, F]
    layers.{i}.mlp.experts.fc2.{weight,bias}  [E, H, F], bias [E, H]
    layers.{i}.mlp.shared.fc1 / fc2           a dense MLP of moe_shared_expert_intermediate_size
    layers.{i}.mlp.shared_gate.weight         [1, H]             with moe_shared_expert_gate

Tensor parallelism (expert tensor parallelism equal to tp) splits each expert's F as the dense
MLP's. Megatron-core trains experts under tp > 1 with sequence parallelism only (the runner's rule
too); without it (generation) every tp rank routes all the tokens and the F-slices' partial sums are
all-reduced. Expert parallelism (tp.experts) gives each of its ep ranks E / ep experts (the leading
dimension of every experts leaf); its ranks are data-parallel ranks, each with its own tokens. Each
rank routes its own tokens (its sequence chunk under sequence parallelism), then the tokens, their
experts and their weights are all-gathered over the dispatch group (tp under sequence parallelism,
times ep: Megatron's allgather token dispatcher), every rank runs its F-slice of its experts on all
of them, and a reduce-scatter returns each rank the sum for its own tokens; or, with the alltoall
dispatcher, each assignment travels to its expert's rank and back by an uneven all-to-all. The
router's weight is replicated: its gradient is summed over tp. An expert's gradient covers the
tokens of every ep rank; data-parallel reduction of expert gradients runs over the
expert-data-parallel ranks only. Under context parallelism (tp.context) each rank routes its
sequence chunks, the balance losses count the whole sequence (parts over tp x cp, Megatron's
sequence partition), and the expert-data-parallel ranks include cp's.

The auxiliary losses (load balancing, z-loss) join the training objective the way Megatron's
MoEAuxLossAutoScaler makes them: their gradient is injected at the layer, with the seed the main
loss's backward starts from (aux.seed: loss scale / microbatches), so no loss value has to travel
through the pipeline. Their values (divided by their coefficients) are written to aux.metrics for
logging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fmeg import ops
from fmeg.models.expert_dispatch import (
    allgather_experts,
    alltoall_experts,
    dispatch_groups,
    fp8_experts,
)
from fmeg.models.mlp import dense_mlp
from fmeg.ops import moe as moe_ops
from fmeg.parallel import collectives as C
from fmeg.parallel.sharding import Partition
from fmeg.parallel.tensor import NO_TP, SEQ_DIM, TensorParallel, replicated_param, token_positions

Params = dict[str, Any]
# Megatron's names: aux.metrics' last axis
METRICS = ("load_balancing_loss", "z_loss", "global_load_balancing_loss")


@dataclass
class AuxLosses:
    """Where a forward pass puts its auxiliary losses: seed, the gradient their sum gets (the main
    loss's backward seed); metrics, a [layers, len(METRICS)] buffer that each MoE layer writes its
    values into (a recomputed layer writes the same values again), or None; counts, a [layers,
    num_experts] buffer for the tokens each expert received here (the expert-bias update's input),
    or None. For global_aux_loss: global_counts, the step's [microbatches, layers, num_experts]
    tokens per expert over every data rank, which this microbatch writes its row of (one_hot
    [microbatches] marks it), and seen [microbatches], 1 for the step's microbatches so far, which
    the counts are averaged over (Megatron's global_tokens_per_expert / ga_steps)."""

    seed: torch.Tensor | float = 1.0
    metrics: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    global_counts: torch.Tensor | None = None
    one_hot: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    # --moe-router-force-load-balancing: the microbatch's key of the random logits
    router_key: Any = None
    # [b, s] True at padded input positions (this rank's context chunk), or None
    padding: torch.Tensor | None = None


NO_AUX = AuxLosses()


def moe_layers(config, mtp: bool = False) -> tuple[bool, ...]:
    """Which layers are MoE layers: Megatron's --moe-layer-freq, an int N (every N-th layer, from
    layer 0) or a per-layer list of 0/1. mtp: followed by the multi-token prediction layers'
    (numbered num_layers + k), which are of the last decoder layer's kind, as megatron-core builds
    them."""
    if not config.experts:
        decoder = (False,) * config.num_layers
    elif isinstance(config.experts.layer_freq, int):
        decoder = tuple(i % config.experts.layer_freq == 0 for i in range(config.num_layers))
    else:
        decoder = tuple(bool(f) for f in config.experts.layer_freq)
    return decoder + decoder[-1:] * (config.mtp_depth) if mtp else decoder


def expert_ffn(config) -> int:
    return config.experts.ffn_hidden_size or config.ffn_hidden_size


# ------------------------------------------------------------------------------------------------
# init


def init_moe(config, seed: int, at: str, normal, linear_params) -> Params:
    """The MoE MLP's parameters at path `at` (layers.{i}.mlp), drawn like the dense layer's
    (normal(shape, std, seed, path) per leaf; output projections with Megatron's scaled std)."""
    c, e, f = config, config.experts.num_experts, expert_ffn(config)
    std, out_std = c.init_std, c.init_std / math.sqrt(2.0 * c.num_layers)
    gated = c.activation in ops.activations.GATES
    fc1_shape = (e, 2, f, c.hidden_size) if gated else (e, f, c.hidden_size)
    p = {
        "router": {"weight": normal((e, c.hidden_size), std, seed, f"{at}.router.weight")},
        "experts": {
            "fc1": linear_params(fc1_shape, std, c.bias, seed, f"{at}.experts.fc1"),
            "fc2": linear_params((e, c.hidden_size, f), out_std, c.bias, seed, f"{at}.experts.fc2"),
        },
    }
    # drawn as megatron-core draws it: with the weights' init method
    if c.experts.router.bias:
        p["router"]["bias"] = normal((e,), std, seed, f"{at}.router.bias")
    if (
        c.experts.router.enable_expert_bias
        # steers the choice of experts only: no gradient reaches it
    ):
        p["router"]["expert_bias"] = torch.zeros(e)
    if c.experts.shared_expert_intermediate_size:
        s = c.experts.shared_expert_intermediate_size
        shared_fc1 = (2, s, c.hidden_size) if gated else (s, c.hidden_size)
        p["shared"] = {
            "fc1": linear_params(shared_fc1, std, c.bias, seed, f"{at}.shared.fc1"),
            "fc2": linear_params((c.hidden_size, s), out_std, c.bias, seed, f"{at}.shared.fc2"),
        }
        if c.experts.shared_expert_gate:
            p["shared_gate"] = {
                "weight": normal((1, c.hidden_size), std, seed, f"{at}.shared_gate.weight")
            }
    return p


# Experts split their F over tp like the dense MLP (dims from the end); the router and shared gate
# replicate. Expert parallelism splits every experts leaf along its leading (expert) dimension.
EP_RULES = tuple(
    (f"{layer}.mlp.experts.{leaf}", Partition(0, "ep"))
    for layer in ("layers.*", "mtp.*.layer")
    for leaf in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
)
TP_RULES = (
    ("layers.*.mlp.experts.fc1.weight", Partition(-2, "etp")),
    ("layers.*.mlp.experts.fc1.bias", Partition(-1, "etp")),
    ("layers.*.mlp.experts.fc2.weight", Partition(-1, "etp")),
    ("layers.*.mlp.shared.fc1.weight", Partition(-2)),
    ("layers.*.mlp.shared.fc1.bias", Partition(-1)),
    ("layers.*.mlp.shared.fc2.weight", Partition(-1)),
)


# ------------------------------------------------------------------------------------------------
# apply


def router_logits(
    p: Params, x_BSH: torch.Tensor, config, tp: TensorParallel = NO_TP
) -> torch.Tensor:
    """[b, s, E] router logits of the tokens held here (in --moe-router-dtype when given)."""
    weight = replicated_param(p["router"]["weight"], tp)
    bias = replicated_param(p["router"].get("bias"), tp)
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(config.experts.router.dtype)
    if dtype is not None:
        return ops.linear(
            x_BSH.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        )
    return ops.linear(x_BSH, weight, bias)


def random_logits(logits_BSE: torch.Tensor, key: Any, tp: TensorParallel = NO_TP) -> torch.Tensor:
    """Megatron's --moe-router-force-load-balancing (a benchmarking switch): standard normal logits
    in place of the router's, which still get the gradient (a straight-through estimator, as
    megatron-core's RandomSTE). Each is keyed by its token's place in the whole [b, s, E] tensor, so
    every layout routes as one device does."""
    b, s, e = logits_BSE.shape
    held, whole = token_positions(s, tp, logits_BSE.device)
    index = (torch.arange(b, device=logits_BSE.device)[:, None] * whole + held)[
        :, :, None
    ] * e + torch.arange(e, device=logits_BSE.device)
    noise = ops.normal(key, index).to(logits_BSE.dtype)
    return noise + (logits_BSE - logits_BSE.detach())


def route_tokens(
    logits_BSE: torch.Tensor, config, expert_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, experts) [b, s, k] for the tokens held here, with token dropping when a capacity is
    set (the capacity counts these tokens: Megatron's router counts its own sequence chunk, and
    takes its tokens sequence-major, [s, b] flattened, as megatron-core's do:
    --moe-token-drop-policy position keeps, for each expert, the tokens of the earliest positions of
    all the sequences first). expert_bias [E] steers the choice (sigmoid routers)."""
    b, s, e = logits_BSE.shape
    router = config.experts.router
    probs, experts = moe_ops.route(
        logits_BSE.transpose(0, 1).reshape(s * b, e),
        topk=router.topk,
        score_function=router.score_function,
        pre_softmax=router.pre_softmax,
        num_groups=router.num_groups,
        group_topk=router.group_topk,
        scaling_factor=router.topk_scaling_factor,
        expert_bias=None if expert_bias is None else expert_bias.detach(),
        group_score_topk=router.group_score_topk,
        normalize=router.norm_topk,
    )
    if config.experts.capacity_factor is not None:
        keep = moe_ops.capacity_keep(
            probs, experts, e, config.experts.capacity_factor, config.experts.token_drop_policy
        )
        probs = probs * keep
    return probs.reshape(s, b, -1).transpose(0, 1), experts.reshape(s, b, -1).transpose(0, 1)


def valid_tokens(
    padding_BS: torch.Tensor | None, tp: TensorParallel = NO_TP
) -> torch.Tensor | None:
    """[b, s] float, 1 for the tokens held here that are not padding (None without a padding mask);
    padding holds this rank's context chunk, whose tp piece a rank holds under sequence
    parallelism."""
    if padding_BS is None:
        return None
    if tp.sp and tp.size > 1:
        padding_BS = padding_BS.chunk(tp.size, dim=SEQ_DIM)[tp.rank]
    return (~padding_BS.bool()).float()


def balance_losses(
    logits_BSE: torch.Tensor,
    config,
    tp: TensorParallel = NO_TP,
    aux: AuxLosses = NO_AUX,
    index: int = 0,
    valid_BS: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's part of each auxiliary loss (coefficient not applied): under sequence and context
    parallelism (Megatron's sequence partition, tp x cp) the parts sum to the loss of the whole
    microbatch, as on one rank. global_aux_loss counts the tokens of every data rank
    (tp.experts.balance_group, megatron-core's tp-dp-cp group), averaged over the step's
    microbatches so far: the parts over every rank sum to the loss of the data-parallel batch, so it
    depends on dp and the microbatches by its definition. valid_BS (valid_tokens): megatron-core's
    padding_mask, the padded tokens' scores and choices left out and the losses' token counts those
    of the others (each sequence counting the sequences' mean for seq_aux_loss; the z-loss a mean
    over them: the whole microbatch's, where megatron-core averages each rank's own mean, which
    would depend on the layout)."""
    out = {}
    b, s, e = logits_BSE.shape
    k, kind = config.experts.router.topk, config.experts.router.load_balancing_type
    partition = [g for g in (tp.group if tp.sp else None, tp.context.group) if g is not None]
    parts = (tp.size if tp.sp else 1) * tp.context.size
    valid = None if valid_BS is None else valid_BS.reshape(b * s, 1)
    if kind != "none" and config.experts.aux_loss_coeff > 0:
        scores, chosen = moe_ops.aux_scores(
            logits_BSE.reshape(b * s, e), k, config.experts.router.score_function
        )
        if valid is not None:
            scores, chosen = scores * valid.to(scores.dtype), chosen * valid.to(chosen.dtype)
        if kind == "aux_loss":
            counts = chosen.sum(dim=0)
            for group in partition:
                counts = C.all_reduce_constant(counts, group)
            total = b * s * parts if valid is None else counts.sum() / k
            out["load_balancing_loss"] = moe_ops.switch_aux_loss(scores, counts, total, k)
        elif kind == "global_aux_loss":
            group = tp.experts.balance_group
            counts = C.all_reduce_constant(chosen.sum(dim=0), group)
            ranks = 1 if group is None else group.size
            # this microbatch's, as megatron-core's
            total = b * s * ranks if valid is None else counts.sum() / k
            # this microbatch's row, then the running average over the step's
            if aux.global_counts is not None:
                rows = aux.global_counts[:, index]
                rows.copy_(torch.where(aux.one_hot[:, None] > 0, counts.to(rows.dtype), rows))
                seen = aux.seen.to(counts.dtype)
                counts = (seen[:, None] * rows.to(counts.dtype)).sum(dim=0) / seen.sum()
            out["global_load_balancing_loss"] = moe_ops.switch_aux_loss(scores, counts, total, k)
        # seq_aux_loss: per sequence, over its whole length (its pieces gathered: the order does not
        # matter)
        else:
            scores = scores.reshape(b, s, e)
            chosen = chosen.reshape(b, s, e)
            for group in partition:
                scores = C.gather_from_sp(scores, group, SEQ_DIM)
                chosen = C.all_gather_constant(chosen, group, SEQ_DIM)
            per_sequence = None if valid is None else chosen.sum() / (k * b)
            out["load_balancing_loss"] = (
                moe_ops.sequence_aux_loss(scores, chosen, k, per_sequence) / parts
            )
    if config.experts.z_loss_coeff:
        if valid is None:
            out["z_loss"] = moe_ops.z_loss(logits_BSE.reshape(b * s, e)) / parts
        # this rank's share of the mean over every unpadded token of the microbatch (one rank's:
        # megatron-core's)
        else:
            held = valid[:, 0].sum()
            whole = held
            for group in partition:
                whole = C.all_reduce_constant(whole, group)
            out["z_loss"] = (
                moe_ops.z_loss(logits_BSE.reshape(b * s, e), valid[:, 0])
                * held
                / whole.clamp(min=1.0)
            )
    return out


class _InjectGradient(torch.autograd.Function):
    """x unchanged; in backward, loss gets gradient `seed` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(x, loss, seed):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, loss, seed = inputs
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        ctx.save_for_backward(seed if torch.is_tensor(seed) else torch.tensor(float(seed)))

    @staticmethod
    def backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        return (
            grad,
            torch.full(ctx.loss_shape, 1.0, dtype=ctx.loss_dtype, device=grad.device)
            * seed.to(grad.device),
            None,
        )

    @staticmethod
    def jvp(ctx, x_t, _loss_t, _seed_t):
        return x_t

    @staticmethod
    def vmap(info, in_dims, x, loss, seed):
        if in_dims[1] is not None:
            raise NotImplementedError("auxiliary losses under vmap over their batch")
        return _InjectGradient.apply(x, loss, seed), in_dims[0]


class _InjectGradientTraced(torch.autograd.Function):
    """_InjectGradient without jvp and vmap rules, which torch.compile can trace."""

    @staticmethod
    def forward(ctx, x, loss, seed):
        ctx.save_for_backward(seed)
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        return grad, seed.expand(ctx.loss_shape).to(grad.dtype), None


def inject_gradient(
    x: torch.Tensor, loss: torch.Tensor, seed: torch.Tensor | float
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _InjectGradientTraced.apply(
            x, loss, torch.as_tensor(seed, device=loss.device, dtype=loss.dtype)
        )
    return _InjectGradient.apply(x, loss, seed)


def _tokens_per_expert(probs, experts, valid, num_experts: int, counts: torch.Tensor):
    """How many tokens each expert took here; padded tokens are routed but not counted
    (megatron-core's padding_mask)."""
    kept = (probs != 0).to(probs.dtype).detach()
    if valid is not None:
        kept = kept * valid[..., None].to(kept.dtype)
    return torch.zeros(num_experts, dtype=counts.dtype, device=probs.device).index_add(
        0, experts.reshape(-1), kept.reshape(-1).to(counts.dtype)
    )


def _with_balance_losses(probs, losses: dict, config, aux: AuxLosses, index: int, parts: int):
    """probs with the weighted balance losses' gradient injected; their values kept in
    aux.metrics as parts that sum over tp to the microbatch's value (parts: tp's size where every
    tp rank holds all the tokens, else 1)."""
    coeffs = {
        "load_balancing_loss": config.experts.aux_loss_coeff,
        "z_loss": config.experts.z_loss_coeff,
        "global_load_balancing_loss": config.experts.aux_loss_coeff,
    }
    total = sum(coeffs[name] * value for name, value in losses.items())
    probs = inject_gradient(probs, total, aux.seed)
    if aux.metrics is not None:
        zero = probs.new_zeros(())
        values = torch.stack([losses.get(name, zero).detach().float() for name in METRICS])
        aux.metrics[index] = values / parts
    return probs


def moe_mlp(
    p: Params,
    x_BSH: torch.Tensor,
    config,
    tp: TensorParallel = NO_TP,
    *,
    activation,
    aux: AuxLosses = NO_AUX,
    index: int = 0,
    recompute: frozenset[str] = frozenset(),
) -> torch.Tensor:
    """The MoE MLP on x [b, s, h] ([b, s/t, h] under sequence parallelism) -> the same shape; the
    auxiliary losses' gradients join at the router's probabilities (see the module docstring).
    recompute (Megatron's --recompute-modules): "moe" runs the dispatch, the experts and the shared
    experts again in backward (the router's logits, its choices and the balance losses are kept:
    they are [tokens, E] and the losses' values are logged once), "moe_act" the experts' activation
    only, "shared_experts" the shared experts."""
    ep = tp.experts
    replicated, dispatch, expert_tp = dispatch_groups(tp)
    logits = router_logits(p, x_BSH, config, tp)
    if config.experts.router.force_load_balancing:
        logits = random_logits(
            logits, ops.fold_in(0 if aux.router_key is None else aux.router_key, index), tp
        )
    probs, experts = route_tokens(logits, config, p["router"].get("expert_bias"))
    valid = valid_tokens(aux.padding, tp)
    if aux.counts is not None:
        # tokens per expert here, for the expert-bias update after the step
        aux.counts[index] = _tokens_per_expert(probs, experts, valid, logits.shape[-1], aux.counts)
    losses = balance_losses(logits, config, tp, aux, index, valid)
    if losses:
        probs = _with_balance_losses(
            probs, losses, config, aux, index, tp.size if replicated else 1
        )
    expert_activation = (
        (lambda h: ops.recomputed(activation, h)) if "moe_act" in recompute else activation
    )
    # compiled graphs take the allgather dispatcher (the same numbers): the all-to-all's counts are
    # host values
    alltoall = (
        config.experts.token_dispatcher_type == "alltoall"
        and not replicated
        and not torch.compiler.is_compiling()
    )
    if alltoall and expert_tp[2] > 1:
        raise ValueError(
            "the alltoall token dispatcher needs an expert tensor-parallel size of 1 "
            "(--expert-tensor-parallel-size 1)"
        )

    grouped = fp8_experts(tp, expert_tp)

    def experts_and_shared(q: Params, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if alltoall:
            y = alltoall_experts(q["experts"], x, probs, experts, ep, expert_activation, grouped)
        else:
            y = allgather_experts(
                q["experts"], x, probs, experts, dispatch, ep, expert_tp, expert_activation, grouped
            )
        if "shared" not in q:
            return y
        if "shared_experts" in recompute and "moe" not in recompute:
            shared = {k: q[k] for k in ("shared", "shared_gate") if k in q}
            return y + ops.recomputed_with(
                lambda s, x: shared_expert(s, x, config, tp, activation), shared, x
            )
        return y + shared_expert(q, x, config, tp, activation)

    held = {k: p[k] for k in ("experts", "shared", "shared_gate") if k in p}
    if "moe" in recompute:
        return ops.recomputed_with(experts_and_shared, held, x_BSH, probs)
    return experts_and_shared(held, x_BSH, probs)


def shared_expert(
    p: Params, x_BSH: torch.Tensor, config, tp: TensorParallel, activation
) -> torch.Tensor:
    """The shared expert (a dense MLP every token goes through), gated by sigmoid(x . w) with a
    shared gate."""
    y = dense_mlp(p["shared"], x_BSH, activation, tp)
    if "shared_gate" in p:
        gate = ops.linear(x_BSH, replicated_param(p["shared_gate"]["weight"], tp))
        y = y * torch.sigmoid(gate)
    return y
