"""SGD and Muon equal torch.optim.SGD and torch.optim.Muon where their definitions agree, within
1e-6 per step over 20 steps on the same gradients; Newton-Schulz equals torch's own iteration
bitwise on inputs its bf16 normalization leaves exact."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim import _muon

from fmeg import optim, tree

STEPS = 20


def params_and_grads(seed: int, shapes: dict, steps: int = STEPS):
    gen = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def run_both(opt, torch_opt, ref, params, grads, lr, wd, atol=1e-6):
    state = opt.init(params)
    for g in grads:
        for k, gk in g.items():
            ref[k].grad = gk.clone()
        torch_opt.step()
        updates, state = opt.update(g, state, params, lr=lr, weight_decay=wd)
        params = optim.apply_updates(params, updates)
        for k, v in params.items():
            torch.testing.assert_close(v, ref[k].detach(), rtol=0, atol=atol, msg=k)
        # each step from the same weights: the states (moments) go on apart
        params = {k: p.detach().clone() for k, p in ref.items()}


@given(st.integers(0, 1000), st.floats(1e-3, 1e-1), st.floats(0.0, 0.2), st.floats(0.0, 0.95))
@settings(max_examples=20, deadline=None)
def test_sgd_equals_torch_sgd_with_megatron_decay_mask(seed, lr, wd, momentum):
    params, grads = params_and_grads(seed, {"w": (5, 3), "bias": (3,)})
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = torch.optim.SGD(
        [
            {"params": [ref["w"]], "weight_decay": wd},
            {"params": [ref["bias"]], "weight_decay": 0.0},
        ],
        lr=lr,
        momentum=momentum,
        foreach=False,
    )
    run_both(optim.sgd(momentum), torch_opt, ref, params, grads, lr, wd)


def torch_iteration_in_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz (torch/optim/_muon.py) with its cast to bf16 left out."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@given(
    st.integers(0, 1000),
    st.floats(1e-3, 5e-2),
    st.floats(0.0, 0.2),
    st.floats(0.5, 0.99),
    st.booleans(),
)
@settings(max_examples=15, deadline=None)
def test_muon_equals_torch_muon_where_they_agree(seed, lr, wd, momentum, nesterov):
    """torch.optim.Muon's defaults are Megatron's Muon with "simple" coefficients and the
    shape_scaling scale; torch runs Newton-Schulz in bf16 only, so both run it in fp32 here (the
    iteration itself is held to torch's bitwise in bf16 below)."""
    params, grads = params_and_grads(seed, {"wide": (4, 9), "tall": (10, 3)})
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = torch.optim.Muon(
        list(ref.values()), lr=lr, weight_decay=wd, momentum=momentum, nesterov=nesterov
    )
    settings_ = optim.MuonSettings(
        momentum=momentum,
        nesterov=nesterov,
        coefficient_type="simple",
        scale_mode="shape_scaling",
        bf16=False,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_muon, "_zeropower_via_newtonschulz", torch_iteration_in_fp32)
        run_both(optim.muon(settings_), torch_opt, ref, params, grads, lr, wd)


@pytest.mark.parametrize("shape", [(16, 16), (8, 32), (32, 8), (4, 64)])
def test_newton_schulz_equals_torchs_bitwise_in_bf16(shape):
    """Entries of +-2^-k whose squares sum to 1: torch's normalization (in bf16) and Megatron's (in
    fp32, then rounded) give the same bf16 matrix, so the iterations must agree bit for bit."""
    gen = torch.Generator().manual_seed(sum(shape))
    side = (shape[0] * shape[1]) ** 0.5
    x = (torch.randint(0, 2, shape, generator=gen) * 2 - 1).float() / side
    assert x.square().sum().item() == 1.0
    want = _muon._zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    got = optim.newton_schulz(x, 5, "simple", bf16=True)
    assert torch.equal(got, want)


def test_newton_schulz_orthogonalizes():
    """Many fp32 steps of polar_express (which keeps its last, converging set) give U V^T."""
    x = torch.randn(12, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    got = optim.newton_schulz(x.float(), 40, "polar_express", bf16=False)
    torch.testing.assert_close(got.double(), u @ vh, atol=2e-2, rtol=0)


def test_every_leaf_of_a_tree_is_stepped_by_its_part():
    params = {"w": torch.ones(3, 4), "norm": torch.ones(4)}
    grads = tree.tree_map(torch.ones_like, params)
    opt = optim.muon()
    state = opt.init(params)
    updates, state = opt.update(grads, state, params, lr=0.1, weight_decay=0.0)
    assert set(state) == {"muon", "scalar"}
    assert set(state["muon"][0].mu) == {"w"}
    # Adam's first step on a constant gradient moves by lr
    torch.testing.assert_close(updates["norm"], torch.full((4,), -0.1))
