"""Hybrid sharding (Megatron's --num-distributed-optimizer-instances): the state sharded within
each instance of dp x cp / N ranks and replicated over the N instances keeps one rank's loss curve
(20 iterations, within 1e-5, dropout on as by default) for the distributed optimizer and
Megatron-FSDP's strategies, with context and pipeline parallelism, and under Muon (whose matrices
are computed at homes within the instance); each rank keeps the state of dp x cp / N ranks' share;
a run saved with instances resumes without them and back on its curve."""

import pytest

from harness import layouts
from harness.layouts import HYBRID2, ZERO1, assert_same
from harness.runner import DROPOUT, run_recipe

LAYOUTS = layouts.rows(
    [
        "dp4_zero1_hybrid2",
        "dp4_fsdp_hybrid2",
        "dp4_optim_grads_hybrid2",
        "cp2_dp2_zero1_hybrid2",
        "pp2_dp2_fsdp_hybrid2",
    ],
    fast=("dp4_zero1_hybrid2",),
)


def curves(tmp_path, name, nproc, flags):
    records, stdout = run_recipe(tmp_path, name, nproc, [*DROPOUT, *flags])
    return {"lm_loss": [r["lm_loss"] for r in records if "lm_loss" in r]}, stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("hybrid"), "single", 1, [])[0]


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_hybrid_sharding_gives_one_ranks_curve(tmp_path, single, name, nproc, flags):
    got, stdout = curves(tmp_path, name, nproc, flags)
    over = "1 rank (whole)" if name.startswith("pp2") else "2 ranks"
    assert f"hybrid: 2 replicas of the state sharded over {over}" in stdout
    assert_same(got, single)


def state_bytes(stdout: str) -> float:
    line = next(x for x in stdout.splitlines() if x.startswith("persistent state per rank"))
    return float(line.split("r0 ")[1].split(",")[0])


@pytest.mark.slow
def test_each_rank_keeps_one_instances_share_of_the_state(tmp_path):
    """In fp32 ZeRO-1 a rank keeps the weights and gradients whole (8 bytes per parameter) and 8 /
    (ranks it shards over) of master-free Adam moments: 2 instances of 2 keep what dp 2 keeps."""
    _, hybrid = curves(tmp_path, "hybrid", 4, [*ZERO1, *HYBRID2, "--train-iters", "3"])
    _, dp2 = curves(tmp_path, "dp2", 2, [*ZERO1, "--train-iters", "3"])
    _, dp4 = curves(tmp_path, "dp4", 4, [*ZERO1, "--train-iters", "3"])
    assert state_bytes(hybrid) == state_bytes(dp2) > state_bytes(dp4)


@pytest.mark.slow
def test_muon_with_hybrid_sharding_gives_one_ranks_curve(tmp_path):
    muon = ["--optimizer", "muon", "--lr", "3e-3", "--muon-fp32-matmul-prec", "high"]
    got, _ = curves(tmp_path, "hybrid", 4, [*muon, *ZERO1, *HYBRID2])
    assert_same(got, curves(tmp_path, "one", 1, muon)[0])


@pytest.mark.slow
def test_a_run_saved_with_instances_resumes_without_and_back_on_its_curve(tmp_path, single):
    hybrid = (4, [*ZERO1, *HYBRID2])
    layouts.assert_resumes_there_and_back(tmp_path, single, hybrid, (2, ZERO1))
