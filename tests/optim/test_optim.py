"""AdamW, clipping and schedules match their formulas (and torch.optim.AdamW) at chosen steps."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg import optim, tree


def params_and_grads(seed, steps):
    gen = torch.Generator().manual_seed(seed)
    params = {
        "layers": [{"w": torch.randn(4, 3, generator=gen), "bias": torch.randn(3, generator=gen)}],
        "norm": {"weight": torch.randn(3, generator=gen)},
    }
    grads = [
        tree.tree_map(lambda t: torch.randn(t.shape, generator=gen), params) for _ in range(steps)
    ]
    return params, grads


@given(
    st.integers(0, 1000),
    st.sampled_from([(0.9, 0.999, 1e-8), (0.8, 0.95, 1e-5)]),
    st.floats(1e-4, 1e-1),
    st.floats(0.0, 0.3),
)
def test_adamw_matches_torch_adamw_with_megatron_decay_mask(seed, betas, lr, wd):
    b1, b2, eps = betas
    params, grads = params_and_grads(seed, 6)
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in tree.flatten(params).items()}
    decayed = [p for k, p in ref.items() if k == "layers.0.w"]  # matrices only: no biases, no norms
    others = [p for k, p in ref.items() if k != "layers.0.w"]
    torch_opt = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": wd}, {"params": others, "weight_decay": 0.0}],
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        foreach=False,
    )
    opt = optim.adamw(b1, b2, eps)
    state = opt.init(params)
    for g in grads:
        for k, gk in tree.flatten(g).items():
            ref[k].grad = gk.clone()
        torch_opt.step()
        updates, state = opt.update(
            g, state, params, lr=torch.tensor(lr), weight_decay=torch.tensor(wd)
        )
        params = optim.apply_updates(params, updates)
    assert state[0].count.item() == 6
    for k, v in tree.flatten(params).items():
        torch.testing.assert_close(v, ref[k].detach(), rtol=1e-5, atol=1e-6, msg=k)


def test_adamw_first_two_steps_by_hand():
    p, g1, g2 = torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([-1.0])
    lr, wd, b1, b2, eps = 0.1, 0.01, 0.9, 0.999, 1e-8
    opt = optim.adamw(b1, b2, eps, decay_mask=lambda path, leaf: True)
    state = opt.init({"p": p})
    u1, state = opt.update({"p": g1}, state, {"p": p}, lr=lr, weight_decay=wd)
    # Step 1: m_hat = g, v_hat = g^2, so the Adam step is lr * g / (|g| + eps).
    want1 = 1.0 - lr * (0.5 / (0.5 + eps) + wd * 1.0)
    p1 = optim.apply_updates({"p": p}, u1)["p"]
    assert p1.item() == pytest.approx(want1, rel=1e-6)
    u2, state = opt.update({"p": g2}, state, {"p": p1}, lr=lr, weight_decay=wd)
    m = (b1 * (1 - b1) * 0.5 + (1 - b1) * -1.0) / (1 - b1**2)
    v = (b2 * (1 - b2) * 0.25 + (1 - b2) * 1.0) / (1 - b2**2)
    want2 = want1 - lr * (m / (math.sqrt(v) + eps) + wd * want1)
    assert optim.apply_updates({"p": p1}, u2)["p"].item() == pytest.approx(want2, rel=1e-6)


def test_adamw_state_is_a_pytree_of_tensors_and_nothing_is_mutated():
    params, grads = params_and_grads(0, 1)
    before = tree.tree_map(torch.clone, params)
    opt = optim.adamw()
    state = opt.init(params)
    opt.update(grads[0], state, params, lr=0.1, weight_decay=0.1)
    assert all(isinstance(x, torch.Tensor) for x in tree.tree_leaves(state))
    assert all(
        torch.equal(a, b) for a, b in zip(tree.tree_leaves(params), tree.tree_leaves(before))
    )
    assert all(not x.any() for x in tree.tree_leaves(state[0].mu))
    assert set(tree.flatten(state[0])) >= {"count", "mu.layers.0.w", "nu.norm.weight"}


@given(st.integers(0, 1000), st.floats(0.01, 10.0))
def test_clip_by_global_norm_matches_formula(seed, max_norm):
    _, (g,) = params_and_grads(seed, 1)
    norm = math.sqrt(sum((t.double() ** 2).sum().item() for t in tree.tree_leaves(g)))
    clip = optim.clip_by_global_norm(max_norm)
    clipped, state = clip.update(g, clip.init(g))
    got_norm = state.norm
    assert got_norm.item() == pytest.approx(norm, rel=1e-6)
    coeff = min(1.0, max_norm / (norm + 1e-6))
    for a, b in zip(tree.tree_leaves(clipped), tree.tree_leaves(g)):
        torch.testing.assert_close(a, b * coeff)
    unclip = optim.clip_by_global_norm(None)
    unclipped, _ = unclip.update(g, unclip.init(g))
    assert unclipped is g


# Schedule values at chosen steps, computed by hand from Megatron's formulas:
# max 1.0, min 0.1, warmup 10, decay ends at 110 (100 decay steps).
S = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)


@pytest.mark.parametrize(
    "style, step, want",
    [
        ("linear", 0, 0.0),
        ("linear", 5, 0.5),
        ("linear", 10, 1.0),
        ("linear", 60, 0.1 + 0.5 * 0.9),
        ("linear", 110, 0.1),
        ("linear", 500, 0.1),
        ("cosine", 60, 0.1 + 0.5 * 0.9),
        ("cosine", 35, 0.1 + 0.5 * (math.cos(math.pi * 0.25) + 1) * 0.9),
        ("cosine", 110, 0.1),
        ("constant", 60, 1.0),
        ("constant", 5, 0.5),
        ("inverse-square-root", 40, max(0.1, 1.0 * math.sqrt(10) / math.sqrt(40))),
        ("inverse-square-root", 1000, 0.1),
    ],
)
def test_lr_schedules_at_chosen_steps(style, step, want):
    assert optim.LRSchedule(style=style, **S)(step) == pytest.approx(want)


@pytest.mark.parametrize(
    "wsd_style, step, want",
    [
        ("linear", 50, 1.0),
        ("linear", 90, 1.0),
        ("linear", 100, 0.1 + 0.5 * 0.9),
        ("cosine", 100, 0.1 + 0.5 * 0.9),
        ("exponential", 100, 0.1 + (2 * 0.5**0.5 - 1) * 0.9),
        ("minus_sqrt", 100, 0.1 + (1 - math.sqrt(0.5)) * 0.9),
        ("exponential", 110, 0.1),
    ],
)
def test_wsd_schedule_stable_then_anneal(wsd_style, step, want):
    s = optim.LRSchedule(style="WSD", wsd_decay_steps=20, wsd_style=wsd_style, **S)
    assert s(step) == pytest.approx(want)


def test_warmup_starts_from_init_lr():
    assert optim.LRSchedule(max_lr=1.0, init_lr=0.2, warmup_steps=4, decay_steps=10)(
        2
    ) == pytest.approx(0.6)


@pytest.mark.parametrize(
    "style, step, want",
    [
        ("constant", 50, 0.1),
        ("linear", 25, 0.1 + 0.25 * 0.2),
        ("linear", 200, 0.3),
        ("cosine", 50, 0.1 + 0.5 * (math.cos(math.pi * 0.5) + 1) * 0.2),
        ("cosine", 100, 0.3),
        ("cosine", 0, 0.1),
    ],
)
def test_weight_decay_increment(style, step, want):
    end = 0.1 if style == "constant" else 0.3
    s = optim.WeightDecaySchedule(start=0.1, end=end, incr_steps=100, style=style)
    assert s(step) == pytest.approx(want)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(style="step"), "--lr-decay-style"),
        (dict(min_lr=2.0), "--min-lr"),
        (dict(warmup_steps=200), "--lr-decay-iters"),
        (dict(style="WSD"), "WSD"),
        (dict(style="WSD", wsd_decay_steps=20, wsd_style="square"), "--lr-wsd-decay-style"),
    ],
)
def test_bad_schedules_are_refused_naming_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optim.LRSchedule(**{**S, **kwargs})


@given(
    st.integers(0, 1000),
    st.sampled_from([(0.9, 0.999, 1e-8), (0.8, 0.95, 1e-5)]),
    st.floats(1e-4, 1e-1),
    st.floats(0.0, 0.3),
    st.sampled_from([0.0, 0.5, 100.0]),
    st.sampled_from([None, 3e-2]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_adamws_pytree_and_flat_forms_make_the_same_updates(
    seed, betas, lr, wd, clip, decoupled_lr, moments
):
    """One AdamW: its chain of transforms over a pytree and its flat form (torch's fused kernel
    stepping flat buffers in place, clipped by grad_scale) agree over three steps, with Megatron's
    decay mask, a decoupled learning rate for one leaf and moments stored in fp32 or bf16."""
    b1, b2, eps = betas
    params, grads = params_and_grads(seed, 3)
    opt = optim.adamw(
        b1,
        b2,
        eps,
        moment_dtypes=(moments, moments),
        decoupled=lambda path, leaf: path == "norm.weight",
    )
    hyper = dict(lr=torch.tensor(lr), weight_decay=torch.tensor(wd), decoupled_lr=decoupled_lr)
    clip_tx = optim.clip_by_global_norm(clip)
    state = opt.init(params)
    leaves = list(tree.items(params))
    flat = {name: torch.cat([p.reshape(-1) for _, p in leaves]) for name in ("master",)}
    sizes = [p.numel() for _, p in leaves]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    mu, nu = torch.zeros(sum(sizes), dtype=moments), torch.zeros(sum(sizes), dtype=moments)
    step = torch.zeros(())
    for g in grads:
        clipped, _ = clip_tx.update(g, None)
        updates, state = opt.update(clipped, state, params, **hyper)
        params = optim.apply_updates(params, updates)
        grad = torch.cat([x.reshape(-1) for x in tree.tree_leaves(g)])
        norm = grad.norm()
        step += 1
        for (path, p), a, n in zip(leaves, starts, sizes):
            views = [[t[a : a + n]] for t in (flat["master"], grad, mu, nu)]
            opt.flat.step_(
                views,
                [step],
                opt.flat.group(path, p),
                lr=lr,
                weight_decay=wd,
                decoupled_lr=decoupled_lr,
                grad_scale=optim.clip_scale(norm, clip),
            )
    got = torch.cat([x.reshape(-1) for x in tree.tree_leaves(params)])
    torch.testing.assert_close(flat["master"], got, rtol=1e-5, atol=1e-6)
    want_mu = torch.cat([x.reshape(-1) for x in tree.tree_leaves(state[0].mu)])
    assert want_mu.dtype == mu.dtype == moments
    torch.testing.assert_close(
        mu.float(), want_mu.float(), rtol=1e-2 if moments == torch.bfloat16 else 1e-5, atol=1e-6
    )
