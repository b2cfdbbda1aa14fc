"""Where Megatron's Muon differs from torch's (quintic coefficients, the bf16 iteration with an
fp32 normalization, the spectral scale, q, k and v orthogonalized apart), and for Lion, adaptive
Muon and SOAP: fmeg's transforms equal plain references written from emerging-optimizers' source
(orthogonalized_optimizer.py, muon_utils.py, muon.py, adaptive_muon.py,
scalar_optimizers/lion.py, legacy_soap/soap.py) and Megatron-LM's TensorParallelMuon
(megatron/core/optimizer/emerging_optimizers.py), the package Megatron-LM calls, which cannot be
installed here. 20 steps on the same gradients, each step from the same weights, within 1e-6."""

import pytest
import torch

from fmeg import optim
from fmeg.models import gpt
from fmeg.models.matrices import GPTMatrices

STEPS = 20
QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def ns_reference(x, steps=5, medium=True):
    """muon_utils.newton_schulz (quintic; fp32_matmul_prec medium: the steps in bf16)."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=1e-15)
    if medium:
        X = X.to(torch.bfloat16)
    for i in range(steps):
        a, b, c = QUINTIC[i % len(QUINTIC)]
        A = X @ X.mT
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def spectral(out, inp):
    return max(out, inp) ** 0.5


class MegatronMuonReference:
    """TensorParallelMuon at tp 1 (duplicated mode), decoupled weight decay, split qkv; adaptive:
    TensorParallelAdaptiveMuon (adamuon), which scales the orthogonalized update, normalizes it by
    its second moment and scales it again (AdaptiveMuon.step after TensorParallelMuon's scaled
    orthogonalize_fn)."""

    def __init__(self, params, lr, wd, momentum, nesterov, qkv_split, adaptive=None):
        self.p, self.lr, self.wd, self.momentum, self.nesterov = params, lr, wd, momentum, nesterov
        self.qkv_split, self.adaptive = qkv_split, adaptive
        self.buf = {k: torch.zeros_like(v) for k, v in params.items()}
        self.m2 = {k: torch.zeros_like(v) for k, v in params.items()}

    def scaled(self, g):
        return ns_reference(g) * spectral(g.size(-2), g.size(-1))

    def orthogonalize(self, name, grad):
        if self.qkv_split and name.endswith("qkv.weight"):
            shapes = self.qkv_split
            groups = grad.shape[0] // sum(shapes)
            parts = torch.split(grad.view(groups, sum(shapes), -1), shapes, dim=1)
            parts = [self.scaled(g.reshape(-1, grad.shape[-1])) for g in parts]
            return torch.cat([o.view(groups, -1, grad.shape[-1]) for o in parts], 1).view(
                grad.shape
            )
        return self.scaled(grad)

    def step(self, grads):
        for name, p in self.p.items():
            grad = grads[name]
            p.add_(p, alpha=-self.wd * self.lr)
            self.buf[name].lerp_(grad, 1 - self.momentum)
            grad = grad.lerp(self.buf[name], self.momentum) if self.nesterov else self.buf[name]
            update = self.orthogonalize(name, grad)
            if self.adaptive:
                beta2, eps = self.adaptive
                self.m2[name].lerp_(update.square(), 1 - beta2)
                update = update / (self.m2[name].sqrt() + eps)
                update = update * spectral(update.size(-2), update.size(-1))
            p.add_(update, alpha=-self.lr)


def lion_reference(params, grads_list, lr, wd, betas):
    """scalar_optimizers Lion: decoupled decay, then calculate_lion_update."""
    exp_avg = {k: torch.zeros_like(v) for k, v in params.items()}
    for grads in grads_list:
        for k, p in params.items():
            p.add_(p, alpha=-wd * lr)
            update = torch.sign(exp_avg[k].lerp(grads[k], 1 - betas[0]))
            exp_avg[k].lerp_(grads[k], 1 - betas[1])
            p.add_(update, alpha=-lr)
        yield {k: v.clone() for k, v in params.items()}


def gqa_config():
    return gpt.GPTConfig(
        vocab_size=64,
        hidden_size=16,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=24,
        max_seq_len=8,
    )


def matrices_and_grads(seed):
    config = gqa_config()
    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "layers.0.attn.qkv.weight": (2 * (2 + 2) * 4, 16),
        "layers.0.attn.proj.weight": (16, 16),
        "layers.0.mlp.fc2.weight": (16, 24),
    }
    params = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(STEPS)]
    return config, params, grads


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("split", [True, False], ids=["split_qkv", "no_split_qkv"])
@pytest.mark.parametrize("adaptive", [None, (0.95, 1e-8)], ids=["muon", "adaptive_muon"])
def test_muon_equals_megatrons_tensor_parallel_muon(nesterov, split, adaptive):
    config, params, grads = matrices_and_grads(1)
    lr, wd, momentum = 0.02, 0.1, 0.9
    d, per_group = config.head_dim, config.heads_per_group
    ref = MegatronMuonReference(
        {k: v.clone() for k, v in params.items()},
        lr,
        wd,
        momentum,
        nesterov,
        [per_group * d, d, d] if split else None,
        adaptive,
    )
    settings = optim.MuonSettings(momentum=momentum, nesterov=nesterov, adaptive=adaptive)
    opt = optim.muon(settings, matrices=GPTMatrices(config, split_qkv=split))
    state = opt.init(params)
    for g in grads:
        ref.step(g)
        updates, state = opt.update(g, state, params, lr=lr, weight_decay=wd)
        params = optim.apply_updates(params, updates)
        for k, v in params.items():
            torch.testing.assert_close(v, ref.p[k], rtol=0, atol=1e-6, msg=k)
        params = {k: v.clone() for k, v in ref.p.items()}


def test_split_qkv_changes_the_update():
    """The split is not a no-op: q, k and v orthogonalized apart differ from the fused matrix."""
    config, params, grads = matrices_and_grads(2)
    path = "layers.0.attn.qkv.weight"
    x = grads[0][path]
    split = GPTMatrices(config, True)
    fused = GPTMatrices(config, False)
    s = optim.MuonSettings()
    from fmeg.optim.muon import orthogonalized

    assert (orthogonalized(x, path, split, s) - orthogonalized(x, path, fused, s)).abs().max() > 0.1


def test_lion_equals_emerging_optimizers_lion():
    gen = torch.Generator().manual_seed(3)
    params = {"w": torch.randn(5, 4, generator=gen), "v": torch.randn(7, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(20)]
    lr, wd, betas = 0.01, 0.1, (0.95, 0.98)
    # Megatron's Lion decays every parameter of its group: here the mask decays all
    opt = optim.lion(*betas, decay_mask=lambda path, leaf: True)
    state = opt.init(params)
    reference = lion_reference({k: v.clone() for k, v in params.items()}, grads, lr, wd, betas)
    for g, want in zip(grads, reference):
        updates, state = opt.update(g, state, params, lr=lr, weight_decay=wd)
        params = optim.apply_updates(params, updates)
        for k, v in params.items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=1e-6, msg=k)
        params = {k: v.clone() for k, v in want.items()}


def test_gpt_matrices_follow_megatrons_split_of_parameters():
    config = gqa_config()
    m = GPTMatrices(config)
    assert m.is_matrix("layers.0.attn.qkv.weight", torch.zeros(32, 16))
    assert m.is_matrix("layers.0.mlp.fc1.weight", torch.zeros(2, 24, 16))
    assert not m.is_matrix("embedding.word.weight", torch.zeros(64, 16))
    assert not m.is_matrix("output.weight", torch.zeros(64, 16))
    assert not m.is_matrix("layers.0.mlp.experts.fc1.bias", torch.zeros(4, 24))
    assert m.is_matrix("layers.0.mlp.experts.fc2.weight", torch.zeros(4, 16, 24))
    fc1 = torch.randn(2, 24, 16)
    assert [t.shape for t in m.split("layers.0.mlp.fc1.weight", fc1)] == [(48, 16)]
    experts = torch.randn(4, 2, 6, 16)
    parts = m.split("layers.0.mlp.experts.fc1.weight", experts)
    assert [t.shape for t in parts] == [(12, 16)] * 4
    assert [len(r) for r in m.row_blocks("layers.0.attn.qkv.weight", 32)] == [16, 8, 8]
    assert torch.equal(m.join("layers.0.mlp.experts.fc1.weight", parts, experts), experts)


class SoapReference:
    """legacy_soap.SOAP.step as Megatron builds it (betas from --adam-beta1/2, shampoo_beta 0.95,
    use_kl_shampoo True, correct_bias True, use_eigh False, power_iter_steps 1, decoupled decay),
    in its in-place style: update_kronecker_factors_kl_shampoo, update_eigenbasis_and_exp_avgs,
    calculate_adam_update."""

    def __init__(self, p, lr, wd, betas=(0.9, 0.999), shampoo_beta=0.95, eps=1e-8):
        self.p, self.lr, self.wd, self.betas, self.sb, self.eps = (
            p,
            lr,
            wd,
            betas,
            shampoo_beta,
            eps,
        )
        m, n = p.shape
        self.s = dict(step=0, exp_avg=torch.zeros(m, n), exp_avg_sq=torch.zeros(m, n))
        self.s.update(L=torch.zeros(m, m), R=torch.zeros(n, n), Q_L=torch.eye(m), Q_R=torch.eye(n))
        self.s.update(eigvals_L=torch.zeros(m), eigvals_R=torch.zeros(n))

    def step(self, grad):
        s, t = self.s, self.s["step"] + 1
        shampoo_beta = 1 - (1 - self.sb) / (1 - self.sb**t)
        updates = []
        for idx, (q, ev) in enumerate([(s["Q_L"], s["eigvals_L"]), (s["Q_R"], s["eigvals_R"])]):
            scale = 1 / grad.shape[idx] * ev.clamp_min(self.eps) ** -1.0
            correction = (q * scale[None, :]) @ q.T
            g = grad.T if idx == 1 else grad
            updates.append(g.mT @ correction @ g)
        for k, u in zip([s["L"], s["R"]], updates[::-1]):
            k.lerp_(u, 1 - shampoo_beta)
        exp_avg = s["exp_avg"]
        for q in [s["Q_L"], s["Q_R"]]:
            exp_avg = torch.tensordot(exp_avg, q, dims=[[0], [1]])
        bases, values = [], []
        for k, q in [(s["L"], s["Q_L"]), (s["R"], s["Q_R"])]:
            if s["step"] == 0:
                ev, vec = torch.linalg.eigh(k)
                ev, vec = torch.flip(ev, [-1]), torch.flip(vec, [-1])
            else:
                vec = torch.linalg.qr(k @ q).Q
                ev = ((vec.mT @ k) * vec.mT).sum(dim=-1)
                order = torch.argsort(ev, descending=True)
                ev, vec = ev[order], vec[:, order]
            bases.append(vec)
            values.append(ev)
        s["Q_L"], s["Q_R"] = bases
        s["eigvals_L"], s["eigvals_R"] = values
        for q in bases:
            exp_avg = torch.tensordot(exp_avg, q, dims=[[0], [0]])
        s["exp_avg"] = exp_avg
        self.p.add_(self.p, alpha=-self.wd * self.lr)
        projected = grad
        for q in bases:
            projected = torch.tensordot(projected, q, dims=[[0], [0]])
        b1, b2 = self.betas
        s["exp_avg"].lerp_(projected, 1 - b1)
        s["exp_avg_sq"].lerp_(projected.square(), 1 - b2)
        update = (s["exp_avg"] / (1 - b1**t)) / ((s["exp_avg_sq"] / (1 - b2**t)).sqrt() + self.eps)
        for q in bases:
            update = torch.tensordot(update, q, dims=[[0], [1]])
        self.p.add_(update, alpha=-self.lr)
        s["step"] += 1


def test_soap_equals_emerging_optimizers_soap_as_megatron_builds_it():
    gen = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(6, 4, generator=gen), "wide": torch.randn(3, 8, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(20)]
    lr, wd = 0.01, 0.1
    refs = {k: SoapReference(v.clone(), lr, wd) for k, v in params.items()}
    opt = optim.soap()
    state = opt.init(params)
    for g in grads:
        for k, ref in refs.items():
            ref.step(g[k])
        updates, state = opt.update(g, state, params, lr=lr, weight_decay=wd)
        params = optim.apply_updates(params, updates)
        for k, v in params.items():
            torch.testing.assert_close(v, refs[k].p, rtol=0, atol=1e-6, msg=k)
        params = {k: ref.p.clone() for k, ref in refs.items()}
