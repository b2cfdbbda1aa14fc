"""Megatron's --optimizer and the flags of SGD, Muon, adaptive Muon, Lion and SOAP, with
Megatron-LM's defaults (megatron/training/arguments.py) and meanings (megatron/core/optimizer);
optimizer_config() is the one place they become each optimizer's settings."""

from __future__ import annotations

from dataclasses import dataclass

from fmeg.config.declare import flag, group, not_positive, outside, switch
from fmeg.optim import MuonSettings, SoapSettings
from fmeg.optim.newton_schulz import COEFFICIENTS, SCALE_MODES

# Megatron's --optimizer choices; dist_muon is Megatron's deprecated name for muon with the
# distributed optimizer
OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")
# adaptive Muon's second moment as Megatron's OptimizerConfig sets it (no flag changes them)
ADAPTIVE_MUON = (0.95, 1e-8)


@group("optimizer choice")
class OptimizerChoiceFlags:
    """Which optimizer, and the settings of those other than Adam."""

    optimizer: str = flag("--optimizer", default="adam", choices=list(OPTIMIZERS))
    sgd_momentum: float = flag("--sgd-momentum", type=float, default=0.9, help="SGD's momentum")
    muon_momentum: float = flag(
        "--muon-momentum", type=float, default=0.9, help="Muon's momentum (an EMA of gradients)"
    )
    muon_split_qkv: bool = flag(
        "--muon-no-split-qkv",
        action="store_false",
        default=True,
        help="orthogonalize the fused qkv weight as one matrix (default: q, k and v apart)",
    )
    muon_nesterov: bool = switch("--muon-nesterov", help="Nesterov momentum inside Muon")
    muon_scale_mode: str = flag(
        "--muon-scale-mode",
        default="spectral",
        choices=list(SCALE_MODES),
        help="spectral: sqrt(max(rows, cols)); shape_scaling: sqrt(max(1, rows / cols)); "
        "unit_rms_norm: sqrt(rows / cols)",
    )
    muon_fp32_matmul_prec: str = flag(
        "--muon-fp32-matmul-prec",
        default="medium",
        choices=["low", "medium", "high"],
        help="medium and low: Newton-Schulz in bf16 (Megatron's default); high: in fp32",
    )
    muon_coefficient_type: str = flag(
        "--muon-coefficient-type",
        default="quintic",
        help=f"Newton-Schulz coefficients: {', '.join(sorted(COEFFICIENTS))}",
    )
    muon_num_ns_steps: int = flag(
        "--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations"
    )
    muon_tp_mode: str = flag(
        "--muon-tp-mode",
        default="duplicated",
        choices=["blockwise", "duplicated", "distributed"],
        help="duplicated and distributed: each matrix orthogonalized whole (the same numbers at "
        "every layout); blockwise: each tensor-parallel shard alone (depends on the layout)",
    )
    muon_extra_scale_factor: float = flag(
        "--muon-extra-scale-factor", type=float, default=1.0, help="Muon's update times this"
    )
    muon_scalar_optimizer: str = flag(
        "--muon-scalar-optimizer",
        default="adam",
        choices=["adam", "lion"],
        help="the optimizer of the embeddings, the output layer, biases and norms under Muon",
    )
    lion_beta1: float = flag(
        "--lion-beta1",
        type=float,
        default=0.95,
        help="the sign-update interpolation of --muon-scalar-optimizer lion (--optimizer lion "
        "takes --adam-beta1, as Megatron)",
    )
    lion_beta2: float = flag(
        "--lion-beta2",
        type=float,
        default=0.98,
        help="the momentum EMA of --muon-scalar-optimizer lion (--optimizer lion takes "
        "--adam-beta2, as Megatron)",
    )
    ACCEPTED = {
        "--muon-use-syrk": dict(
            action="store_true",
            help="a Triton kernel for the Gram matrix: accepted, the numbers are the same",
        )
    }

    def problems(self) -> list[str]:
        out = not_positive(self, "muon_num_ns_steps")
        out += outside(self, "sgd_momentum", 0, 1) + outside(self, "muon_momentum", 0, 1)
        out += outside(self, "lion_beta1", 0, 1) + outside(self, "lion_beta2", 0, 1)
        if self.muon_coefficient_type not in COEFFICIENTS:
            out.append(
                f"--muon-coefficient-type {self.muon_coefficient_type}: expected one of "
                f"{', '.join(sorted(COEFFICIENTS))}"
            )
        elif self.muon_coefficient_type == "cubic5" and self.muon_num_ns_steps != 5:
            out.append(
                "--muon-coefficient-type cubic5 is a fixed 5-step schedule: give "
                "--muon-num-ns-steps 5"
            )
        return out


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer the runner steps, from the flags."""

    # adam, sgd, lion, muon, adaptive_muon or soap (dist_muon is muon)
    name: str = "adam"
    # Adam's (b1, b2, eps): Adam's, and that of the leaves Lion, Muon and SOAP leave to Adam
    adam: tuple[float, float, float] = (0.9, 0.999, 1e-8)
    sgd_momentum: float = 0.9
    # --optimizer lion's (b1, b2), of the Lion on the matrices
    lion: tuple[float, float] = (0.9, 0.999)
    soap: SoapSettings = SoapSettings()
    muon: MuonSettings = MuonSettings()
    # Muon's scalar optimizer: adam or lion, that Lion's (b1, b2)
    muon_scalar: str = "adam"
    muon_scalar_lion: tuple[float, float] = (0.95, 0.98)
    muon_split_qkv: bool = True
    # each tensor-parallel shard orthogonalized alone (layout-dependent)
    blockwise: bool = False

    @property
    def state_kind(self) -> str:
        """What its state holds, as checkpoints record it: a run resumes only a state of its own
        kind (Muon's first moments are momentum buffers; with Lion on the rest there is no nu).
        --optimizer lion's is "lion+adam" (Lion on the matrices, Adam's moments on the rest):
        "lion", Lion on every leaf, is what fmeg stepped before it followed Megatron-LM."""
        muon = self.name in ("muon", "adaptive_muon")
        if self.name == "lion":
            return "lion+adam"
        return f"{self.name}+lion" if muon and self.muon_scalar == "lion" else self.name

    @property
    def label(self) -> str:
        """The start line's words for it."""
        if self.name in ("muon", "adaptive_muon"):
            m = self.muon
            return (
                f"{self.name} ({m.coefficient_type} x{m.num_ns_steps}, "
                f"{'bf16' if m.bf16 else 'fp32'}, {m.scale_mode}"
                f"{', blockwise' if self.blockwise else ''}; {self.muon_scalar} on the rest)"
            )
        if self.name == "soap":
            return "soap (KL-Shampoo factors, Adam in their eigenbasis; adam on the rest)"
        if self.name == "lion":
            return "lion (on the matrices; adam on the rest)"
        return self.name


def optimizer_config(a, adam: tuple[float, float, float]) -> OptimizerConfig:
    """The optimizer's configuration from the flags (a: their namespace; adam: --adam-beta1,
    --adam-beta2, --adam-eps), each optimizer's settings as Megatron-LM main gives them.

    Megatron routes every --optimizer but adam and sgd through its emerging optimizers
    (megatron/core/optimizer/__init__.py, emerging_optimizers.py): the word embedding, the output
    layer and every parameter that is not 2-D go to Adam (--adam-*), under Muon to
    --muon-scalar-optimizer. Lion and SOAP are built by _default_adam_based_eopt_config_to_kwargs:
    betas (--adam-beta1, --adam-beta2), every other argument of the class from the OptimizerConfig
    field named <optimizer>_<argument> or <argument>, else the class' default. Checked against
    emerging-optimizers 0.3.0 (the release Megatron-LM pins in pyproject.toml),
    scalar_optimizers/lion.py and soap/soap.py:

    - Lion(lr, betas, weight_decay, weight_decay_method="decoupled"): lr and weight_decay are
      the run's; --lion-beta1/2 reach only the Lion of --muon-scalar-optimizer lion
      (_get_megatron_optimizer_based_on_param_groups).
    - SOAP: shampoo_beta from soap_shampoo_beta (0.95) and use_kl_shampoo from
      soap_use_kl_shampoo (True), OptimizerConfig fields no flag sets; SOAP's own defaults for the
      rest: eps 1e-8 (OptimizerConfig has adam_eps, no eps), decoupled weight decay, no Nesterov,
      correct_bias (and the shampoo_beta bias correction), use_eigh False (eigh at the first step
      only, then power_iter_steps 1 of QR), fp32_matmul_prec and qr_fp32_matmul_prec "high",
      max_update_rms 0 (no clip), the eigenbasis updated every step; those SoapSettings has no
      field for are what fmeg.optim.soap always does.
    """
    name = "muon" if a.optimizer == "dist_muon" else a.optimizer
    b1, b2, _ = adam
    return OptimizerConfig(
        name=name,
        adam=adam,
        sgd_momentum=a.sgd_momentum,
        lion=(b1, b2),
        soap=SoapSettings(b1, b2, eps=1e-8, shampoo_beta=0.95, kl_shampoo=True, power_iter_steps=1),
        muon=MuonSettings(
            momentum=a.muon_momentum,
            nesterov=a.muon_nesterov,
            num_ns_steps=a.muon_num_ns_steps,
            coefficient_type=a.muon_coefficient_type,
            scale_mode=a.muon_scale_mode,
            extra_scale_factor=a.muon_extra_scale_factor,
            bf16=a.muon_fp32_matmul_prec != "high",
            adaptive=ADAPTIVE_MUON if name == "adaptive_muon" else None,
        ),
        muon_scalar=a.muon_scalar_optimizer,
        muon_scalar_lion=(a.lion_beta1, a.lion_beta2),
        muon_split_qkv=a.muon_split_qkv,
        blockwise=a.muon_tp_mode == "blockwise",
    )
