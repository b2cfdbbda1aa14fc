"""Mixture of experts: the routed, grouped-matmul layer equals a plain loop over experts; routing,
token dropping and the balance losses equal their definitions written token by token; under tensor
and sequence parallelism the model's loss and every gradient equal one device's."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import spmd_programs as P
from fmeg import tree
from fmeg.models import gpt, moe
from fmeg.ops import moe as moe_ops
from fmeg.parallel.sharding import partition_of, unshard
from harness.parallel import run
from harness.moe_steps import (
    assert_per_token_step_has_the_gradient_of,
    batch_for,
    lm_and_balance,
    moe_config,
)

f64 = torch.float64


def gated(h):
    return F.silu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2 :]


# --- routing, written token by token --------------------------------------------------------------


def route_one_token(logits, k, score_function, pre_softmax, groups, group_topk, scale, bias):
    """Megatron's routing for one token's logits [E], as plain Python: (experts, probs) sorted by
    expert."""
    e = len(logits)
    if score_function == "softmax":
        scores = torch.softmax(logits, 0) if pre_softmax else logits
    else:
        scores = torch.sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    allowed = list(range(e))
    if group_topk:
        size = e // groups
        best = sorted(
            range(groups),
            key=lambda g: (
                -sum(sorted(choice[g * size : (g + 1) * size].tolist())[-(k // group_topk) :])
            ),
        )
        allowed = [i for g in best[:group_topk] for i in range(g * size, (g + 1) * size)]
    chosen = sorted(allowed, key=lambda i: -choice[i].item())[:k]
    if score_function == "softmax":
        probs = torch.softmax(logits[chosen], 0) if not pre_softmax else scores[chosen]
    else:
        probs = scores[chosen]
        probs = probs / probs.sum() if k > 1 else probs
    if scale:
        probs = probs * scale
    order = sorted(range(k), key=lambda j: chosen[j])
    return [chosen[j] for j in order], probs[order]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_routing_equals_its_definition_token_by_token(data):
    groups = data.draw(st.sampled_from([None, 2, 4]))
    e = (groups or 1) * data.draw(st.integers(1, 3)) if groups else data.draw(st.integers(1, 8))
    group_topk = data.draw(st.integers(1, groups)) if groups else None
    per_group = e // groups if groups else e
    k = (
        group_topk * data.draw(st.integers(1, per_group))
        if groups
        else data.draw(st.integers(1, e))
    )
    score = data.draw(st.sampled_from(moe_ops.SCORE_FUNCTIONS))
    pre = score == "softmax" and data.draw(st.booleans())
    scale = data.draw(st.sampled_from([None, 2.5]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    logits = torch.randn(7, e, generator=gen, dtype=f64)
    bias = (
        torch.randn(e, generator=gen, dtype=f64) * 0.1
        if score == "sigmoid" and data.draw(st.booleans())
        else None
    )
    probs, experts = moe_ops.route(
        logits,
        topk=k,
        score_function=score,
        pre_softmax=pre,
        num_groups=groups,
        group_topk=group_topk,
        scaling_factor=scale,
        expert_bias=bias,
    )
    for t in range(logits.shape[0]):
        want_e, want_p = route_one_token(logits[t], k, score, pre, groups, group_topk, scale, bias)
        order = experts[t].argsort()
        assert experts[t][order].tolist() == want_e
        torch.testing.assert_close(probs[t][order].double(), want_p, rtol=1e-6, atol=1e-7)


# --- the experts ----------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_grouped_experts_equal_a_loop_over_experts_with_every_gradient(data):
    """Sorted tokens through grouped matmuls (torch._grouped_mm or the per-expert fallback) equal
    each expert applied to every token and masked; splitting the experts between holders (expert
    parallelism's shards) sums to the same."""
    e, t, h = (
        data.draw(st.integers(1, 6)),
        data.draw(st.integers(1, 12)),
        data.draw(st.sampled_from([4, 8])),
    )
    f, k = data.draw(st.sampled_from([3, 4, 8])), data.draw(st.integers(1, 6))
    k = min(k, e)
    is_gated = data.draw(st.booleans())
    # fp32 takes torch._grouped_mm where aligned
    dtype = data.draw(st.sampled_from([torch.float32, f64]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    x = torch.randn(t, h, generator=gen, dtype=dtype)
    fc1 = torch.randn(e, *((2,) if is_gated else ()), f, h, generator=gen, dtype=dtype)
    fc2 = torch.randn(e, h, f, generator=gen, dtype=dtype)
    logits = torch.randn(t, e, generator=gen, dtype=dtype)
    act = gated if is_gated else F.gelu
    cot = torch.randn(t, h, generator=gen, dtype=dtype)

    def ours(x, fc1, fc2, logits):
        probs, experts = moe_ops.route(logits, topk=k)
        return moe_ops.expert_mlp(x, probs.to(dtype), experts, fc1, fc2, act)

    def reference(x, fc1, fc2, logits):
        probs, experts = moe_ops.route(logits, topk=k)
        return moe_ops.reference_moe(x, probs.to(dtype), experts, fc1, fc2, act)

    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    args = (x, fc1, fc2, logits)
    got, got_vjp = torch.func.vjp(ours, *args)
    want, want_vjp = torch.func.vjp(reference, *args)
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_vjp(cot), want_vjp(cot)):
        torch.testing.assert_close(g, w, **tol)
    split = data.draw(st.integers(0, e))

    def halves(x, fc1, fc2, logits):
        probs, experts = moe_ops.route(logits, topk=k)
        return moe_ops.expert_mlp(
            x, probs.to(dtype), experts, fc1[:split], fc2[:split], act
        ) + moe_ops.expert_mlp(
            x, probs.to(dtype), experts, fc1[split:], fc2[split:], act, first_expert=split
        )

    got, got_vjp = torch.func.vjp(halves, *args)
    torch.testing.assert_close(got, want, **tol)
    # the other holder's rows give no gradient, not garbage
    for g, w in zip(got_vjp(cot), want_vjp(cot)):
        torch.testing.assert_close(g, w, **tol)


# --- token dropping and the balance losses
# ----------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_capacity_keeps_each_experts_best_or_first_tokens(data):
    e, t = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 16))
    k, factor = (
        min(data.draw(st.integers(1, 3)), e),
        data.draw(st.sampled_from([0.25, 0.5, 1.0, 2.0])),
    )
    policy = data.draw(st.sampled_from(moe_ops.DROP_POLICIES))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    probs, experts = moe_ops.route(torch.randn(t, e, generator=gen, dtype=f64), topk=k)
    keep = moe_ops.capacity_keep(probs, experts, e, factor, policy)
    capacity = math.ceil(t * k / e * factor)
    assert capacity == moe_ops.capacity(t, e, k, factor)
    for expert in range(e):
        routed = [(tok, j) for tok in range(t) for j in range(k) if experts[tok, j] == expert]
        kept = [a for a in routed if keep[a]]
        # megatron-core's: whichever torch.topk returns of the equal 0/1 entries
        if policy == "position":
            assert len(kept) == min(capacity, len(routed))
        else:  # the best `capacity` probabilities (ties may go either way)
            dropped = [a for a in routed if not keep[a]]
            assert len(kept) == min(capacity, len(routed))
            assert not dropped or min(probs[a] for a in kept) >= max(probs[a] for a in dropped)
    assert not keep[experts < 0].any()


@pytest.mark.parametrize("policy", moe_ops.DROP_POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_token_dropping_keeps_what_megatron_cores_router_keeps(policy, seed):
    """megatron-core's router takes a [s, b] microbatch's tokens sequence-major and drops past each
    expert's capacity by probability or by "position" (apply_router_token_dropping: torch.topk over
    the routing map); fmeg's route_tokens, given the same logits as [b, s], keeps the same (token,
    expert) assignments."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    b, s, e, k = 3, 8, 4, 2
    config = gpt.GPTConfig(
        vocab_size=16,
        max_seq_len=s,
        num_layers=1,
        hidden_size=8,
        num_heads=2,
        num_experts=e,
        moe_router_topk=k,
        moe_expert_capacity_factor=0.5,
        moe_token_drop_policy=policy,
    )
    logits = torch.randn(b, s, e, generator=torch.Generator().manual_seed(seed), dtype=f64)
    logits[:, :, 0] += 2.0  # every token wants expert 0: its capacity drops some
    probs, experts = moe.route_tokens(logits, config)
    kept = torch.zeros(b, s, e, dtype=torch.bool).scatter(2, experts, probs > 0)
    routed, chosen = moe_ops.route(logits.transpose(0, 1).reshape(s * b, e), topk=k)
    dense = torch.zeros(s * b, e, dtype=f64).scatter(1, chosen, routed)
    _, theirs = moe_utils.apply_router_token_dropping(dense, dense > 0, k, 0.5, drop_policy=policy)
    assert 0 < int(kept.sum()) < b * s * k  # some were dropped
    assert torch.equal(kept, theirs.reshape(s, b, e).transpose(0, 1))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_balance_losses_equal_their_definitions_and_split_over_sequence_chunks(data):
    e, b, s = (
        data.draw(st.integers(2, 6)),
        data.draw(st.integers(1, 3)),
        data.draw(st.sampled_from([2, 4, 8])),
    )
    k = data.draw(st.integers(1, e))
    score = data.draw(st.sampled_from(moe_ops.SCORE_FUNCTIONS))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    logits = torch.randn(b, s, e, generator=gen, dtype=f64)
    scores, chosen = moe_ops.aux_scores(logits.reshape(-1, e), k, score)
    raw = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    raw = raw / raw.sum(-1, keepdim=True)
    torch.testing.assert_close(scores.double(), raw.reshape(-1, e))
    # Switch: E * sum_i (fraction of the T*k assignments to i) * (mean score of i)
    t = b * s
    fraction = chosen.sum(0) / (t * k)
    want = e * (fraction * scores.mean(0)).sum()
    whole = moe_ops.switch_aux_loss(scores, chosen.sum(0), t, k)
    torch.testing.assert_close(whole, want)
    chunks = 2  # sequence parallelism: each part's scores with the whole's counts
    parts = sum(
        moe_ops.switch_aux_loss(sc.reshape(-1, e), chosen.sum(0), t, k)
        for sc in scores.reshape(b, s, e).chunk(chunks, dim=1)
    )
    torch.testing.assert_close(parts, whole)
    # sequence-level: the switch loss of each sequence, averaged
    per_seq = [
        moe_ops.switch_aux_loss(scores.reshape(b, s, e)[i], chosen.reshape(b, s, e)[i].sum(0), s, k)
        for i in range(b)
    ]
    torch.testing.assert_close(
        moe_ops.sequence_aux_loss(scores.reshape(b, s, e), chosen.reshape(b, s, e), k),
        sum(per_seq) / b,
    )
    torch.testing.assert_close(
        moe_ops.z_loss(logits.reshape(-1, e)),
        (torch.logsumexp(logits, -1) ** 2).mean().float(),
        check_dtype=False,
    )


# --- the model ------------------------------------------------------------------------------------


def plain_objective(params, batch, config):
    """The one-device definition: each MoE layer a loop over experts, and the objective the LM loss
    plus every layer's coefficient-weighted balance losses (what the injected gradients add up
    to)."""
    return sum(lm_and_balance(params, batch, config))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "moe_router_score_function": "sigmoid",
            "moe_router_num_groups": 2,
            "moe_router_group_topk": 1,
            "moe_shared_expert_intermediate_size": 8,
            "moe_shared_expert_gate": True,
            "moe_router_load_balancing_type": "seq_aux_loss",
            "moe_router_topk_scaling_factor": 2.0,
        },
        {
            "moe_expert_capacity_factor": 0.5,
            "moe_token_drop_policy": "position",
            "activation": "gelu",
            "bias": True,
        },
    ],
    ids=["mixtral", "deepseek", "capacity_gelu_bias"],
)
def test_the_moe_model_gradients_are_those_of_lm_loss_plus_balance_losses(overrides):
    config = moe_config(**overrides)
    params, batch = gpt.init(config, 0, dtype=f64), batch_for(config)
    got = torch.func.grad(lambda p: gpt.loss(p, batch, config))(params)
    want = torch.func.grad(lambda p: plain_objective(p, batch, config))(params)
    for path, g in tree.items(got):
        torch.testing.assert_close(g, tree.flatten(want)[path], rtol=1e-9, atol=1e-10, msg=path)
    assert tree.flatten(got)["layers.1.mlp.router.weight"].abs().sum() > 0


def test_per_token_loss_scales_each_balance_loss_by_all_its_microbatchs_tokens_as_megatron_core():
    """--calculate-per-token-loss with loss masks: megatron-core's router scales its aux loss by the
    tokens it routed (activation.shape[0], masked or not), and the step divides every gradient by
    the global batch's loss tokens; so the objective is (sum of the token losses + sum over
    microbatches of tokens x balance losses) / loss tokens. Seeding the aux losses with the
    loss-masked count instead moved the router's gradient by 8e-2."""
    config = moe_config(moe_z_loss_coeff=1e-2)
    params = gpt.init(config, 0)
    g = torch.Generator().manual_seed(1)
    microbatches = []
    for seed, keep in ((0, 0.8), (1, 0.3)):
        mb = batch_for(config, seed=seed)
        microbatches.append(
            {**mb, "loss_mask": (torch.rand(mb["tokens"].shape, generator=g) < keep).float()}
        )
    got = assert_per_token_step_has_the_gradient_of(
        params, microbatches, config, lambda mb: mb["tokens"].numel()
    )
    assert tree.flatten(got)["layers.1.mlp.router.weight"].abs().sum() > 0


@pytest.mark.parametrize(
    "backend, world, balance",
    [
        ("threads", 2, "aux_loss"),
        ("threads", 4, "aux_loss"),
        ("threads", 2, "seq_aux_loss"),
        ("gloo", 2, "aux_loss"),
    ],
)
def test_moe_under_tensor_and_sequence_parallelism_equals_one_device(backend, world, balance):
    """Experts' F split over tp, tokens gathered over the sequence chunks: loss and every gradient
    (the router's summed over tp) equal one device's, aux and z losses included."""
    config = moe_config(
        moe_shared_expert_intermediate_size=8,
        num_kv_heads=4,
        moe_router_load_balancing_type=balance,
    )
    params, batch = gpt.init(config, 0), batch_for(config)
    want_grads, want_loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config))(params)
    results = run(
        backend, world, P.gpt_loss_and_grads, params, batch, config, None, sequence_parallel=True
    )
    got = unshard([g for _, g in results], gpt.TP_RULES, "tp")
    for loss, _ in results:
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for path, g in tree.items(got):
        torch.testing.assert_close(
            g, tree.flatten(want_grads)[path], rtol=1e-5, atol=1e-6, msg=path
        )
    for _, g in results:
        for path, leaf in tree.items(g):
            if partition_of(path, gpt.TP_RULES) is None:
                torch.testing.assert_close(leaf, tree.flatten(results[0][1])[path], msg=path)


def test_moe_under_tensor_parallelism_without_sp_equals_one_device():
    """Generation's layout (tp without sequence parallelism): every rank routes all tokens, F-slices
    all-reduced; loss and every gradient equal one device's."""
    config = moe_config(
        moe_shared_expert_intermediate_size=8, num_kv_heads=4, bias=True, activation="gelu"
    )
    params, batch = gpt.init(config, 0), batch_for(config)
    want_grads, want_loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config))(params)
    results = run("threads", 2, P.gpt_loss_and_grads, params, batch, config, None)
    got = unshard([g for _, g in results], gpt.TP_RULES, "tp")
    for loss, _ in results:
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for path, g in tree.items(got):
        torch.testing.assert_close(
            g, tree.flatten(want_grads)[path], rtol=1e-5, atol=1e-6, msg=path
        )


@pytest.mark.parametrize(
    "backend, world, tp, dispatcher",
    [
        ("threads", 2, 1, "allgather"),
        ("threads", 4, 2, "allgather"),
        ("gloo", 2, 1, "allgather"),
        ("threads", 4, 1, "allgather"),
        ("threads", 2, 1, "alltoall"),
        ("threads", 4, 1, "alltoall"),
        ("gloo", 4, 1, "alltoall"),
    ],
)
def test_expert_parallelism_equals_one_device(backend, world, tp, dispatcher):
    """Each ep rank holds E / ep experts and its own batch (ep ranks are data-parallel ranks): its
    loss is one device's loss of that batch; its dense gradients are that loss's, its experts'
    gradients those of the sum of every ep rank's loss (what the expert-data-parallel reduction then
    averages), tp 2 + sp inside. Both token dispatchers: all-gather / reduce-scatter, and the uneven
    all-to-all."""
    from fmeg.parallel.sharding import shard

    ep = world // tp
    config = moe_config(
        num_experts=4,
        moe_shared_expert_intermediate_size=8,
        num_kv_heads=4,
        bias=True,
        activation="gelu",
        moe_token_dispatcher_type=dispatcher,
    )
    params = gpt.init(config, 0)
    batches = [batch_for(config, s=8) for _ in range(ep)]
    for r, b in enumerate(batches):  # a different batch on each ep rank
        b["tokens"] = (b["tokens"] + 7 * r) % config.vocab_size
    per_batch = [
        torch.func.grad_and_value(lambda p, b=b: gpt.loss(p, b, config))(params) for b in batches
    ]
    total = torch.func.grad(lambda p: sum(gpt.loss(p, b, config) for b in batches))(params)
    rules = gpt.TP_RULES + moe.EP_RULES
    results = run(
        backend,
        world,
        P.expert_parallel_loss_and_grads,
        params,
        batches,
        config,
        ep,
        tp=tp,
        ep=ep,
        sequence_parallel=tp > 1,
    )
    for loss, grads, coords in results:
        own_grads, own_loss = per_batch[coords["ep"][0]]
        torch.testing.assert_close(loss, own_loss, rtol=1e-6, atol=1e-6)
        want = {
            path: (tree.flatten(total)[path] if ".experts." in path else g)
            for path, g in tree.items(own_grads)
        }
        want = tree.flatten(shard(tree.unflatten(want), rules, coords))
        for path, g in tree.items(grads):
            torch.testing.assert_close(g, want[path], rtol=1e-5, atol=1e-6, msg=path)


def test_experts_compile_into_one_graph_with_the_eager_numbers():
    """Under torch.compile (fullgraph) the experts run without a host sync (the grouped kernel where
    the dtype allows it, else every expert on every row, masked) and give the eager values and
    gradients."""
    gen = torch.Generator().manual_seed(0)
    x, logits = torch.randn(12, 8, generator=gen), torch.randn(12, 4, generator=gen)
    fc1, fc2 = torch.randn(4, 2, 6, 8, generator=gen), torch.randn(4, 8, 6, generator=gen)

    def f(x, fc1, fc2, logits):
        probs, experts = moe_ops.route(logits, topk=2)
        return moe_ops.expert_mlp(x, probs, experts, fc1, fc2, gated).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    args = (x, fc1, fc2, logits)
    want = torch.func.grad(f, argnums=(0, 1, 2, 3))(*args)
    got = torch.autograd.grad(compiled(*[a.requires_grad_() for a in args]), args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_alltoall_dispatcher_refuses_experts_split_over_tp_in_one_line():
    from fmeg.config.arguments import parse_args
    from fmeg.config.validation import validate

    flags = [
        "--num-experts",
        "4",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ]
    assert [p for p in validate(parse_args(flags, 2), 2) if "dispatcher" in p] == [
        "--moe-token-dispatcher-type alltoall: fmeg's all-to-all moves tokens to experts that are "
        "not split over tp (expert tp 2); add --expert-tensor-parallel-size 1 or use allgather"
    ]
    assert validate(parse_args([*flags, "--expert-tensor-parallel-size", "1"], 2), 2) == []


@pytest.mark.parametrize("backend, world", [("threads", 1), ("threads", 2), ("gloo", 2)])
def test_global_aux_loss_counts_every_data_rank_averaged_over_the_steps_microbatches(
    backend, world
):
    """Megatron's global_aux_loss: at microbatch j each rank's part is the switch loss of its scores
    against the tokens per expert of every data rank, averaged over microbatches 0..j, over (its
    tokens x ranks); the parts over the ranks sum to that loss of the ranks' tokens together. On one
    rank and one microbatch it is aux_loss."""
    config = moe_config(
        moe_router_load_balancing_type="global_aux_loss", num_experts=4, moe_router_topk=2
    )
    gen = torch.Generator().manual_seed(5)
    m, b, s, e, k = 3, 2, 4, 4, 2
    logits = [
        [torch.randn(b, s, e, generator=gen, dtype=f64) for _ in range(m)] for _ in range(world)
    ]
    parts = (
        torch.stack(run(backend, world, P.global_balance_loss_parts, logits, config, tp=1))
        if world > 1
        else P.global_balance_loss_parts(
            type("M", (), {"group": lambda self, n: None, "coord": lambda self, n: 0})(),
            logits,
            config,
        )[None]
    )
    chosen = [
        [moe_ops.aux_scores(x.reshape(-1, e), k, "softmax")[1].sum(0) for x in rank]
        for rank in logits
    ]
    for j in range(m):
        counts = sum(chosen[r][i] for r in range(world) for i in range(j + 1)) / (j + 1)
        scores = torch.cat(
            [moe_ops.aux_scores(logits[r][j].reshape(-1, e), k, "softmax")[0] for r in range(world)]
        )
        want = moe_ops.switch_aux_loss(scores, counts, b * s * world, k)
        torch.testing.assert_close(parts[:, j].sum(), want, rtol=1e-12, atol=1e-12)
    first = moe.balance_losses(logits[0][0], moe_config(num_experts=4, moe_router_topk=2))[
        "load_balancing_loss"
    ]
    if world == 1:
        torch.testing.assert_close(parts[0, 0], first)


def _forced_logits(mesh, logits, key):
    from fmeg.parallel.tensor import TensorParallel

    tp = TensorParallel(mesh.group("tp"), mesh.sequence_parallel)
    return moe.random_logits(logits.chunk(tp.size, dim=1)[tp.rank], key, tp)


def test_forced_load_balancing_routes_by_keyed_normal_logits_that_pass_the_gradient_through():
    """--moe-router-force-load-balancing: standard normal logits keyed by each token's place (so a
    sequence-parallel rank draws its rows of one device's), the router's logits still getting the
    gradient (megatron-core's RandomSTE)."""
    from harness.parallel import run

    logits = torch.randn(4, 64, 16, requires_grad=True)
    forced = moe.random_logits(logits, 11)
    assert abs(forced.mean().item()) < 0.05 and abs(forced.std().item() - 1.0) < 0.05
    assert not torch.equal(forced, moe.random_logits(logits, 12))
    forced.backward(torch.full_like(forced, 3.0))
    assert torch.equal(logits.grad, torch.full_like(logits, 3.0))
    shards = run("threads", 4, _forced_logits, logits.detach(), 11, sequence_parallel=True)
    assert torch.equal(torch.cat(shards, dim=1), forced.detach())
