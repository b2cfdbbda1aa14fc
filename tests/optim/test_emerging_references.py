"""Where Megatron's Muon differs from torch's (quintic coefficients, the bf16 iteration with an
fp32 normalization, the spectral scale, q, k and v orthogonalized apart), and for Lion, adaptive
Muon and SOAP: fmeg's transforms equal plain references written from emerging-optimizers' source
(orthogonalized_optimizer.py, muon_utils.py, muon.py, adaptive_muon.py; for Lion and SOAP the
0.3.0 release Megatron-LM pins: scalar_optimizers/lion.py, soap/soap.py, soap/soap_utils.py,
utils/eig.py) and Megatron-LM's TensorParallelMuon and emerging-optimizer path
(megatron/core/optimizer/emerging_optimizers.py, __init__.py), the package Megatron-LM calls,
which is not installed here. 20 steps on the same gradients, each step from the same weights,
within 1e-6; --optimizer lion and soap as the runner builds them from parsed flags, 20 steps on
from the same start, within 1e-5."""

import contextlib

import pytest
import torch

from fmeg import optim, tree
from fmeg.config.load import load
from fmeg.models import gpt
from fmeg.models.matrices import GPTMatrices
from fmeg.parallel.mesh import Mesh
from fmeg.training import optimizers
from fmeg.training.parallel_step import embedding_or_output, init_state, shard_params

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


@contextlib.contextmanager
def matmul_precision(precision):
    """emerging-optimizers' utils.fp32_matmul_precision."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class SoapReference:
    """emerging-optimizers 0.3.0's SOAP.step as Megatron builds it (betas from --adam-beta1/2,
    SOAP's own eps 1e-8, shampoo_beta 0.95, use_kl_shampoo True, correct_bias True, use_eigh False,
    power_iter_steps 1, fp32_matmul_prec and qr_fp32_matmul_prec "high", decoupled decay), in its
    in-place style: update_kronecker_factors_kl_shampoo (the eigenvalues taken as diag(Q^T K Q)
    of the factors before this gradient), update_eigenbasis_and_exp_avgs (the old bases sorted by
    the new factors' diag(Q^T K Q), exp_avg_sq permuted alike, then eigh at the first step or one
    QR iteration), calculate_adam_update."""

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

    @staticmethod
    def approx_eigvals(k, q):
        return ((q.T @ k) * q.T).sum(dim=1)

    def step(self, grad):
        with matmul_precision("high"):
            self._step(grad.float())

    def _step(self, grad):
        s, t = self.s, self.s["step"] + 1
        shampoo_beta = 1 - (1 - self.sb) / (1 - self.sb**t)
        factors, bases = [s["L"], s["R"]], [s["Q_L"], s["Q_R"]]
        updates = []
        for idx, (k, q) in enumerate(zip(factors, bases)):
            scale = 1 / grad.shape[idx] * self.approx_eigvals(k, q).clamp_min(self.eps) ** -1.0
            correction = (q * scale[None, :]) @ q.T
            g = grad.T if idx == 1 else grad
            updates.append(g.T @ correction @ g)
        for k, u in zip(factors, updates[::-1]):
            k.lerp_(u, 1 - shampoo_beta)
        exp_avg = s["exp_avg"]
        for q in bases:
            exp_avg = torch.tensordot(exp_avg, q, dims=[[0], [1]])
        exp_avg_sq, started = s["exp_avg_sq"], []
        for idx, (k, q) in enumerate(zip(factors, bases)):
            order = torch.argsort(self.approx_eigvals(k, q), descending=True)
            started.append(q[:, order])
            exp_avg_sq = exp_avg_sq.index_select(idx, order)
        new = []
        for k, q in zip(factors, started):
            if s["step"] == 0:
                new.append(torch.flip(torch.linalg.eigh(k)[1], [-1]))
            else:
                new.append(torch.linalg.qr(k @ q).Q)
        for q in new:
            exp_avg = torch.tensordot(exp_avg, q, dims=[[0], [0]])
        s["Q_L"], s["Q_R"], s["exp_avg"], s["exp_avg_sq"] = *new, exp_avg, exp_avg_sq
        self.p.add_(self.p, alpha=-self.wd * self.lr)
        projected = grad
        for q in new:
            projected = torch.tensordot(projected, q, dims=[[0], [0]])
        b1, b2 = self.betas
        s["exp_avg"].lerp_(projected, 1 - b1)
        s["exp_avg_sq"].lerp_(projected.square(), 1 - b2)
        update = (s["exp_avg"] / (1 - b1**t)) / ((s["exp_avg_sq"] / (1 - b2**t)).sqrt() + self.eps)
        for q in new:
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


class LionReference:
    """emerging-optimizers 0.3.0's Lion.step: decoupled decay, then calculate_lion_update."""

    def __init__(self, p, lr, wd, betas):
        self.p, self.lr, self.wd, self.betas = p, lr, wd, betas
        self.exp_avg = torch.zeros_like(p)

    def step(self, grad):
        self.p.add_(self.p, alpha=-self.wd * self.lr)
        update = torch.sign(self.exp_avg.lerp(grad, 1 - self.betas[0]))
        self.exp_avg.lerp_(grad, 1 - self.betas[1])
        self.p.add_(update, alpha=-self.lr)


class AdamReference:
    """The Adam of the parameters Megatron's emerging path leaves to Adam (torch.optim.AdamW's
    update, as TE's and apex's FusedAdam in adam_w_mode compute it)."""

    def __init__(self, p, lr, wd, betas, eps):
        self.p, self.lr, self.wd, self.betas, self.eps = p, lr, wd, betas, eps
        self.m, self.v, self.t = torch.zeros_like(p), torch.zeros_like(p), 0

    def step(self, grad):
        self.t += 1
        b1, b2 = self.betas
        self.p.mul_(1 - self.lr * self.wd)
        self.m.lerp_(grad, 1 - b1)
        self.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (self.v / (1 - b2**self.t)).sqrt() + self.eps
        self.p.addcdiv_(self.m, denom, value=-self.lr / (1 - b1**self.t))


def megatron_parameter(path, leaf):
    """The Megatron parameter a GPT leaf ("stage.path") is: a gated MLP's fc1 [2, F, H] is
    Megatron's linear_fc1 weight [2F, H]; the other leaves of this dense model are as Megatron
    holds them."""
    return leaf.reshape(-1, leaf.shape[-1]) if path.endswith("mlp.fc1.weight") else leaf


def megatron_emerging(name, params, lr, wd, adam_betas, adam_eps):
    """Megatron-LM main's _get_megatron_emerging_optimizer for --optimizer lion / soap, one
    reference per parameter (a view of a copy of its leaf): _is_nonlinear_or_embedding's
    parameters (is_embedding_or_output_parameter: the word embedding and the output layer; or not
    2-D) by Adam (--adam-beta1/2, --adam-eps), the others by _create_emerging_optimizer's Lion or
    SOAP, whose kwargs are betas=(--adam-beta1, --adam-beta2) and their classes' defaults
    (OptimizerConfig has no field of their other arguments' names; soap_shampoo_beta 0.95 and
    soap_use_kl_shampoo True are SOAP's). The weight decay is get_standard_config_overrides':
    none on biases and 1-D parameters."""
    refs = {}
    for path, leaf in params.items():
        p = megatron_parameter(path, leaf)
        decay = wd * (not (p.dim() == 1 or path.endswith(".bias")))
        if path.endswith(("embedding.word.weight", "output.weight")) or p.dim() != 2:
            refs[path] = AdamReference(p, lr, decay, adam_betas, adam_eps)
        elif name == "lion":
            refs[path] = LionReference(p, lr, decay, adam_betas)
        else:
            refs[path] = SoapReference(p, lr, decay, adam_betas)
    return refs


# a dense GPT with every kind of leaf Megatron's split sees: GQA qkv with its bias, a gated fc1
# [2, F, H], RMSNorm weights, an untied word embedding and output layer (RoPE: no position table)
MODEL = [
    "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "24", "--swiglu",
    "--disable-bias-linear", "--add-qkv-bias", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--vocab-size", "32", "--make-vocab-size-divisible-by", "8", "--seq-length", "8",
    "--max-position-embeddings", "8",
]  # fmt: skip
# Adam's flags away from their defaults: Lion and SOAP take the betas, Adam the eps too
FLAGS = ["--adam-beta1", "0.85", "--adam-beta2", "0.99", "--adam-eps", "1e-6"]


@pytest.mark.parametrize("name", ["lion", "soap"])
def test_the_runners_lion_and_soap_from_flags_equal_megatrons(name):
    """The runner's state (init_state of the parsed flags' optimizer: the flat form it steps) and
    the pytree form of the same optimizer (over the stage's tree, as fmeg.optim's transforms take
    it), from the same weights on the same gradients, stay within 1e-5 of Megatron's optimizers
    over 20 steps."""
    cfg, _ = load([*MODEL, "--optimizer", name, *FLAGS], 1)
    c, mesh, lr, wd = cfg.model, Mesh.single(), 1e-2, 0.1
    params = shard_params(gpt.init(c, 0), c, cfg.layout, mesh)
    state = init_state(params, c, cfg.layout, mesh, optimizer=cfg.training.optimizer)
    tx = optimizers.build(cfg.training.optimizer, c, embedding_or_output(cfg.layout))
    weights = {path: leaf.clone() for path, leaf in tree.items(params)}
    refs = megatron_emerging(name, weights, lr, wd, (0.85, 0.99), 1e-6)
    stage, gen = params[0], torch.Generator().manual_seed(0)
    tx_state = tx.init(stage)
    for _ in range(STEPS):
        grads = tree.tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        for path, g in tree.items(grads):
            refs[path].step(megatron_parameter(path, g))
        state.grad.copy_(state.flat.flatten(grads))
        state.step(mesh, lr=lr, weight_decay=wd, clip_grad=0.0)
        updates, tx_state = tx.update(grads[0], tx_state, stage, lr=lr, weight_decay=wd)
        stage = optim.apply_updates(stage, updates)
        for (path, flat), pytree in zip(tree.items(state.params), tree.tree_leaves(stage)):
            torch.testing.assert_close(flat, weights[path], rtol=0, atol=1e-5, msg=path)
            torch.testing.assert_close(pytree, weights[path], rtol=0, atol=1e-5, msg=path)
