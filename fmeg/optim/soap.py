"""SOAP (Shampoo with Adam in the preconditioner's eigenbasis), Megatron's --optimizer soap, as
emerging-optimizers 0.3.0's SOAP (soap/soap.py, soap/soap_utils.py, utils/eig.py; the release
Megatron-LM pins) defines it with the settings Megatron gives it (fmeg.config.optimizer_flags'
optimizer_config): Adam's betas from --adam-beta1/2, SOAP's own eps 1e-8, shampoo_beta 0.95,
KL-Shampoo factors, bias correction, the eigenbasis from eigh at the first step and one step of
orthogonal (QR) iteration after, its matmuls at torch's "high" float32 precision; the matrices by
SOAP, every other leaf by Adam.

For a matrix G (m x n) with factors L (m x m), R (n x n) and eigenbases Q_L, Q_R, at step t:

    beta = 1 - (1 - shampoo_beta) / (1 - shampoo_beta^t)
    d_L = max(diag(Q_L^T L Q_L), eps), d_R likewise                (before L, R take G)
    L <- beta L + (1 - beta) / n * G Q_R diag(1 / d_R) Q_R^T G^T      (KL-Shampoo)
    R <- beta R + (1 - beta) / m * G^T Q_L diag(1 / d_L) Q_L^T G
    exp_avg back to the parameter's basis; Q_L's columns sorted by diag(Q_L^T L Q_L) descending
    (Q_R's by R's), exp_avg_sq's rows and columns permuted alike; Q_L, Q_R from L, R (eigh at
    t = 1, else Q <- qr(L Q)); exp_avg into the new basis
    update = Q_L adam(Q_L^T G Q_R) Q_R^T         (Adam's moments kept in the rotated basis)
    W <- W (1 - lr wd) - lr update

matrix_direction() is the one definition; the runner computes it on each matrix gathered whole at
its home rank (fmeg.state.matrix_step), where the matrix's state lives.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, NamedTuple

import torch

from fmeg.optim.adam import adamw
from fmeg.optim.base import GradientTransformation, without_stage
from fmeg.optim.matrix_flat import MatrixFlat, matrices_and_the_rest
from fmeg.optim.muon import LeafMatrices, TwoDimensional
from fmeg.optim.transforms import Mask, default_decay_mask

Tree = Any
# a matrix's state, by name: exp_avg, exp_avg_sq (in the eigenbasis), L, R, Q_L, Q_R, step (0-d)
MatrixState = dict[str, torch.Tensor]

# SOAP's fp32_matmul_prec and qr_fp32_matmul_prec defaults (Megatron sets neither): torch's
# "high", TF32 matmuls on a GPU that has them (plain fp32 where the hardware has no faster form)
MATMUL_PRECISION = "high"
# torch's float32 matmul precision is one setting of the process: SOAP's steps on thread ranks
# (fmeg.parallel.spmd) take turns setting and restoring it
_precision_lock = threading.Lock()


class SoapSettings(NamedTuple):
    """SOAP's settings as Megatron passes them (fmeg.config.optimizer_flags.optimizer_config)."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    shampoo_beta: float = 0.95
    kl_shampoo: bool = True
    power_iter_steps: int = 1


def matrix_state(m: int, n: int, device: Any = None) -> MatrixState:
    """A fresh state of an m x n matrix."""
    z = dict(device=device, dtype=torch.float32)
    return {
        "exp_avg": torch.zeros(m, n, **z),
        "exp_avg_sq": torch.zeros(m, n, **z),
        "L": torch.zeros(m, m, **z),
        "R": torch.zeros(n, n, **z),
        "Q_L": torch.eye(m, **z),
        "Q_R": torch.eye(n, **z),
        "step": torch.zeros((), dtype=torch.int64, device=device),
    }


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """torch's float32 matmul precision set to precision inside, restored after (as
    emerging-optimizers' fp32_matmul_precision)."""
    with _precision_lock:
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)


def _project_in(x: torch.Tensor, bases: list[torch.Tensor]) -> torch.Tensor:
    # tensordot, as emerging-optimizers projects (matmul rounds differently)
    for q in bases:
        x = torch.tensordot(x, q, dims=[[0], [0]])
    return x


def _project_out(x: torch.Tensor, bases: list[torch.Tensor]) -> torch.Tensor:
    for q in bases:
        x = torch.tensordot(x, q, dims=[[0], [1]])
    return x


def _diagonal(k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """diag(q^T k q): k's approximate eigenvalues in the basis q."""
    return ((q.T @ k) * q.T).sum(dim=1)


def _eigenvectors(k: torch.Tensor) -> torch.Tensor:
    """k's eigenvectors, largest eigenvalue first (in fp64 if fp32 fails, as emerging's
    eigh_with_fallback)."""
    try:
        vectors = torch.linalg.eigh(k)[1]
    except (torch.linalg.LinAlgError, RuntimeError):
        vectors = torch.linalg.eigh(k.double())[1].float()
    return vectors.flip(-1)


def _factors(g: torch.Tensor, st: MatrixState, beta: float, s: SoapSettings) -> tuple:
    """L and R after this gradient (KL-Shampoo's, or Shampoo's outer products)."""
    if not s.kl_shampoo:
        return st["L"].lerp(g @ g.T, 1 - beta), st["R"].lerp(g.T @ g, 1 - beta)
    updates = []
    for dim, (k, q) in enumerate(((st["L"], st["Q_L"]), (st["R"], st["Q_R"]))):
        scale = 1 / g.shape[dim] * _diagonal(k, q).clamp_min(s.eps) ** -1.0
        correction = (q * scale[None, :]) @ q.T
        p = g.T if dim == 1 else g
        updates.append(p.T @ correction @ p)
    # the left factor takes the right basis' correction and the other way round
    return st["L"].lerp(updates[1], 1 - beta), st["R"].lerp(updates[0], 1 - beta)


def _sorted(
    factors: tuple[torch.Tensor, ...], bases: tuple[torch.Tensor, ...], exp_avg_sq: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each basis' columns by the new factor's approximate eigenvalues, largest first, and
    exp_avg_sq's axes permuted alike (0.3.0's sort_eigenbasis_by_approx_eigvals): the columns the
    orthogonal iteration starts from, and the second moment's slots, follow the eigenvalues."""
    out = []
    for dim, (k, q) in enumerate(zip(factors, bases)):
        order = torch.argsort(_diagonal(k, q), descending=True)
        out.append(q[:, order])
        exp_avg_sq = exp_avg_sq.index_select(dim, order)
    return out, exp_avg_sq


def _bases(factors: tuple, bases: list[torch.Tensor], first: bool, steps: int) -> list:
    """The new eigenbases: eigh at the first step, else steps of orthogonal iteration from the
    sorted bases."""
    if first:
        return [_eigenvectors(k) for k in factors]
    out = []
    for k, q in zip(factors, bases):
        for _ in range(steps):
            q = torch.linalg.qr(k @ q).Q
        out.append(q)
    return out


def matrix_direction(
    g: torch.Tensor, st: MatrixState, s: SoapSettings
) -> tuple[torch.Tensor, MatrixState]:
    """SOAP's update direction of one whole matrix from its fp32 gradient, and its new state."""
    g = g.float()
    t = int(st["step"]) + 1
    beta = 1 - (1 - s.shampoo_beta) / (1 - s.shampoo_beta**t)
    with _matmul_precision(MATMUL_PRECISION):
        factors = _factors(g, st, beta, s)
        exp_avg = _project_out(st["exp_avg"], [st["Q_L"], st["Q_R"]])
        bases, exp_avg_sq = _sorted(factors, (st["Q_L"], st["Q_R"]), st["exp_avg_sq"])
        bases = _bases(factors, bases, t == 1, s.power_iter_steps)
        exp_avg = _project_in(exp_avg, bases)
        projected = _project_in(g, bases)
        exp_avg = exp_avg.lerp(projected, 1 - s.b1)
        exp_avg_sq = exp_avg_sq.lerp(projected.square(), 1 - s.b2)
        adam = (exp_avg / (1 - s.b1**t)) / ((exp_avg_sq / (1 - s.b2**t)).sqrt() + s.eps)
        direction = _project_out(adam, bases)
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "L": factors[0], "R": factors[1]}
    new.update(Q_L=bases[0], Q_R=bases[1], step=st["step"] + 1)
    return direction, new


def leaf_direction(
    path: str, whole: torch.Tensor, states: list[MatrixState] | None, matrices, s: SoapSettings
) -> tuple[torch.Tensor, list[MatrixState]]:
    """A whole leaf's direction, each of its parameters (matrices.split) stepped by SOAP; states:
    theirs (None: fresh)."""
    parts, new = [], []
    for i, m in enumerate(matrices.split(path, whole)):
        st = matrix_state(*m.shape, device=m.device) if states is None else states[i]
        u, st = matrix_direction(m, st, s)
        parts.append(u)
        new.append(st)
    return matrices.join(path, parts, whole), new


def scale_by_soap(s: SoapSettings, matrices: LeafMatrices) -> GradientTransformation:
    """SOAP's direction of each leaf of a tree of matrix leaves ({path: leaf}); the state is
    {path: [each parameter's MatrixState]}."""

    def init(params: Tree) -> dict:
        return {path: None for path in params}

    def update(updates: Tree, state: dict, params: Tree = None, **hyper: Any):
        out, new = {}, {}
        for path, g in updates.items():
            out[path], new[path] = leaf_direction(path, g, state[path], matrices, s)
        return out, new

    return GradientTransformation(init, update)


@dataclass(frozen=True)
class SoapFlat(MatrixFlat):
    """soap's update over the runner's flat buffers: the scalar leaves by Adam's flat form; the
    matrix leaves (group "muon": the matrix step's) by whole_step() at their home rank, which
    keeps their states."""

    kinds: ClassVar[tuple[str, ...]] = ("mu", "nu")
    name: ClassVar[str] = "soap"
    keeps_matrix_state: ClassVar[bool] = True

    def prepare_(self, mu, grad, grad_scale) -> torch.Tensor:
        return grad / grad_scale if grad_scale is not None else grad.clone()

    def whole_step(self, path: str, whole: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        return leaf_direction(without_stage(path), whole, state, self.matrices, self.settings)

    def fresh_state(self, path: str, whole_shape: tuple[int, ...], device: Any) -> list:
        """The states of a leaf of this whole shape before its first step."""
        probe = torch.empty(whole_shape, device="meta")
        parts = self.matrices.split(without_stage(path), probe)
        return [matrix_state(*m.shape, device=device) for m in parts]


def soap(
    settings: SoapSettings = SoapSettings(),
    scalar: GradientTransformation | None = None,
    matrices: LeafMatrices = TwoDimensional(),
    decay_mask: Mask = default_decay_mask,
) -> GradientTransformation:
    """SOAP on matrices.is_matrix's leaves (decoupled weight decay where decay_mask says), scalar
    (default: adamw with SOAP's betas and eps) on the others."""
    if scalar is None:
        scalar = adamw(settings.b1, settings.b2, settings.eps, decay_mask=decay_mask)
    flat = SoapFlat(settings, matrices, scalar.flat, decay_mask)
    direction = scale_by_soap(settings, matrices)
    return matrices_and_the_rest("soap", direction, scalar, matrices, decay_mask, flat)
