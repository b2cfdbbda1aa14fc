"""Newton-Schulz orthogonalization and Muon's update scales, as emerging-optimizers defines them
(the package Megatron-LM's --optimizer muon calls).

    o = newton_schulz(m, steps=5, coefficients="quintic", bf16=True)   # ~ U V^T of m = U S V^T
    o * scale_factor(rows, cols, "spectral")

Each step is X <- a X + (b A + c A A) X with A = X X^T, X the matrix (transposed when it has more
rows than columns, so that A is the smaller Gram matrix), normalized first by its Frobenius norm.
With bf16 (Megatron's --muon-fp32-matmul-prec medium, its default) the normalization runs in fp32
and the iterations in bf16, the result returned in fp32; otherwise everything runs in fp32.
"""

from __future__ import annotations

import itertools

import torch

Coefficients = tuple[float, float, float]

# emerging_optimizers.orthogonalized_optimizers.muon_utils: (a, b, c) per step
COEFFICIENTS: dict[str, list[Coefficients]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "cans": [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
    "cubic5": [
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ],
}
# after its last set, a schedule of these keeps the last one; the others start over
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
# F.normalize's floor on the norm (emerging-optimizers' default eps)
NORM_EPS = 1e-15


def schedule(coefficients: str, steps: int) -> list[Coefficients]:
    """The (a, b, c) of each of `steps` iterations."""
    if coefficients not in COEFFICIENTS:
        raise ValueError(
            f"Newton-Schulz coefficients {coefficients!r}: expected one of {sorted(COEFFICIENTS)}"
        )
    sets = COEFFICIENTS[coefficients]
    if coefficients == "cubic5" and steps != len(sets):
        raise ValueError(f"cubic5 is a fixed {len(sets)}-step schedule; got {steps} steps")
    more = itertools.repeat(sets[-1]) if coefficients in REPEAT_LAST else itertools.cycle(sets)
    return list(itertools.islice(itertools.chain(sets, more), steps))


def newton_schulz(
    m: torch.Tensor, steps: int = 5, coefficients: str = "quintic", bf16: bool = True
) -> torch.Tensor:
    """The orthogonalization of the 2-D fp32 matrix m (its shape), as emerging-optimizers'
    newton_schulz computes it."""
    if m.dim() != 2:
        raise ValueError(f"newton_schulz: a matrix, got shape {tuple(m.shape)}")
    transpose = m.size(0) > m.size(1)
    x = m.float().mT if transpose else m.float()
    x = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=NORM_EPS)
    if bf16:
        x = x.bfloat16()
    for a, b, c in schedule(coefficients, steps):
        gram = x @ x.mT
        if c != 0.0:
            x = torch.addmm(x, torch.addmm(gram, gram, gram, alpha=c, beta=b), x, beta=a)
        else:
            x = torch.addmm(x, gram, x, alpha=b, beta=a)
    x = x.float()
    return x.mT if transpose else x


def scale_factor(rows: int, cols: int, mode: str = "spectral") -> float:
    """The factor Muon multiplies a rows x cols orthogonalized update by: spectral sqrt(max(rows,
    cols)) (Kimi's, Megatron's default), shape_scaling sqrt(max(1, rows / cols)) (Keller Jordan's,
    torch.optim.Muon's), unit_rms_norm sqrt(rows / cols)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"Muon scale mode {mode!r}: expected one of {SCALE_MODES}")
