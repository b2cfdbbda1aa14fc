"""Layout invariance of a mixture of experts with default flags otherwise: the loss curve and the logged
load-balancing and z losses at tp 2 with sp, pp 2 with virtual stages, and dp 2 with the distributed optimizer
equal one rank's within 1e-5 over 20 iterations (the balance losses' gradients join at each layer, with the
seed the pipeline's loss backward starts from)."""

import pytest

from runner_harness import run_recipe

# Mixtral-style routing (top-2 of 4 experts, aux loss, z-loss) on a DeepSeek-style layer pattern (a dense first
# layer) with a shared expert.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-layer-freq", "([0]+[1]*3)", "--swiglu", "--ffn-hidden-size", "16", "--moe-ffn-hidden-size", "8",
       "--moe-shared-expert-intermediate-size", "8"]
LAYOUTS = [("pp2_virtual", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
           ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           ("dp2_zero1", 2, ["--use-distributed-optimizer"])]
NAMES = ("lm_loss", "load_balancing_loss", "z_loss")


def curves(tmp_path, name, nproc, flags):
    records, _ = run_recipe(tmp_path, name, nproc, [*MOE, *flags])
    return {key: [r[key] for r in records if "lm_loss" in r] for key in NAMES}


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("moe"), "single", 1, [])


@pytest.mark.parametrize("name, nproc, flags", [pytest.param(*row, marks=() if row[0] == "pp2_virtual" else
                                                             pytest.mark.slow) for row in LAYOUTS],
                         ids=[row[0] for row in LAYOUTS])
def test_moe_curves_and_balance_losses_are_layout_invariant(tmp_path, moe_reference, name, nproc, flags):
    got = curves(tmp_path, name, nproc, flags)
    for key in NAMES:
        assert len(got[key]) == len(moe_reference[key]) == 20
        for a, b in zip(got[key], moe_reference[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], moe_reference[key])


def test_the_balance_losses_change_the_training(tmp_path, moe_reference):
    """The injected gradients act: without the aux and z losses the curve differs."""
    records, _ = run_recipe(tmp_path, "no_aux", 1, [*MOE, "--moe-aux-loss-coeff", "0", "--moe-z-loss-coeff", "0"])
    plain = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert plain[0] == pytest.approx(moe_reference["lm_loss"][0], rel=1e-6)  # same model, same first batch
    assert abs(plain[-1] - moe_reference["lm_loss"][-1]) > 1e-4
    assert "load_balancing_loss" not in records[0] and "z_loss" not in records[0]
