"""--optimizer and its settings as Megatron-LM reads them: its defaults, dist_muon as muon with
the distributed optimizer, --muon-fp32-matmul-prec's precisions, Muon's scalar optimizer, the
betas and eps Lion and SOAP take."""

import pytest

from fmeg.config.load import BadInput, load
from fmeg.optim import MuonSettings, SoapSettings

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]


def choice(*flags: str, world: int = 1):
    cfg, _ = load([*BASE, *flags], world)
    return cfg.training.optimizer, cfg.layout


def test_the_default_is_adam_and_muons_defaults_are_megatrons():
    adam, _ = choice()
    assert adam.name == "adam" and adam.state_kind == "adam"
    muon, _ = choice("--optimizer", "muon")
    # megatron/training/arguments.py: momentum 0.9, no Nesterov, quintic x5, spectral, medium
    assert muon.muon == MuonSettings(0.9, False, 5, "quintic", "spectral", 1.0, True, None)
    assert muon.muon_scalar == "adam" and muon.muon_split_qkv and not muon.blockwise


def test_dist_muon_is_muon_with_the_distributed_optimizer():
    muon, layout = choice("--optimizer", "dist_muon", world=2)
    assert muon.name == "muon" and layout.sharding == "optim"


def test_muon_flags_reach_its_settings():
    muon, _ = choice(
        "--optimizer",
        "adaptive_muon",
        "--muon-momentum",
        "0.95",
        "--muon-nesterov",
        "--muon-fp32-matmul-prec",
        "high",
        "--muon-coefficient-type",
        "polar_express",
        "--muon-num-ns-steps",
        "8",
        "--muon-scale-mode",
        "unit_rms_norm",
        "--muon-extra-scale-factor",
        "0.2",
        "--muon-scalar-optimizer",
        "lion",
        "--muon-no-split-qkv",
        "--muon-tp-mode",
        "blockwise",
    )
    assert muon.muon == MuonSettings(
        0.95, True, 8, "polar_express", "unit_rms_norm", 0.2, False, (0.95, 1e-8)
    )
    assert muon.muon_scalar == "lion" and not muon.muon_split_qkv and muon.blockwise
    assert muon.state_kind == "adaptive_muon+lion"
    assert "blockwise" in muon.label


def test_sgd_lion_and_soap_take_megatrons_flags():
    sgd, _ = choice("--optimizer", "sgd", "--sgd-momentum", "0.5")
    assert sgd.sgd_momentum == 0.5
    lion, _ = choice("--optimizer", "lion")
    assert lion.lion == (0.9, 0.999) and lion.label == "lion (on the matrices; adam on the rest)"
    # Megatron's emerging path gives Lion and SOAP --adam-beta1/2; --lion-beta1/2 reach only
    # Muon's scalar Lion; SOAP's eps is its own
    flags = ("--adam-beta1", "0.8", "--adam-beta2", "0.9", "--adam-eps", "1e-6")
    lion, _ = choice("--optimizer", "lion", *flags)
    assert lion.lion == (0.8, 0.9) and lion.adam == (0.8, 0.9, 1e-6)
    soap, _ = choice("--optimizer", "soap", *flags)
    assert soap.soap == SoapSettings(0.8, 0.9, 1e-8, 0.95, True, 1)
    lion_betas = ("--lion-beta1", "0.5", "--lion-beta2", "0.6")
    muon, _ = choice("--optimizer", "muon", "--muon-scalar-optimizer", "lion", *flags, *lion_betas)
    assert muon.muon_scalar_lion == (0.5, 0.6)
    # where they would do nothing, they are refused, naming the flag that does it
    for name in ("lion", "soap"):
        with pytest.raises(BadInput) as e:
            choice("--optimizer", name, *flags, "--lion-beta1", "0.5")
        assert e.value.lines == (
            f"--lion-beta1 is read by --muon-scalar-optimizer lion; --optimizer {name} takes its "
            "betas from --adam-beta1/2, as Megatron-LM's does: give --adam-beta1 instead",
        )
