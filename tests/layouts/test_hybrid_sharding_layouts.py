"""Hybrid sharding (Megatron's --num-distributed-optimizer-instances): the state sharded within
each instance of dp x cp / N ranks and replicated over the N instances keeps one rank's loss curve
(20 iterations, within 1e-5, dropout on as by default) for the distributed optimizer and
Megatron-FSDP's strategies, with context and pipeline parallelism, and under Muon (whose matrices
are computed at homes within the instance), and with the experts laid out apart (ep 2, expert tp
1); each rank keeps the state of dp x cp / N ranks' share; a run saved with instances resumes
without them and back on its curve."""

import pytest

from harness import layouts
from harness.layouts import CP2, EP2, EXPERTS_MODEL, FSDP, HYBRID2, TP2_SP, ZERO1, assert_same
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


# the experts laid out apart: their state sliced within the instance's expert data-parallel ranks
# (expert_dp / N) and summed over the instances, as megatron-core's partial expert groups
EXPERT_LAYOUTS = [
    pytest.param("ep2_dp4_zero1_hybrid2", 4, [*EP2, *ZERO1, *HYBRID2], id="ep2_dp4_zero1_hybrid2"),
    pytest.param(
        "ep2_dp4_fsdp_hybrid2", 4, [*EP2, *FSDP, *HYBRID2], id="ep2_dp4_fsdp_hybrid2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "cp2_ep2_dp2_zero1_hybrid2", 4, [*CP2, *EP2, *ZERO1, *HYBRID2],
        id="cp2_ep2_dp2_zero1_hybrid2", marks=pytest.mark.slow,
    ),
    pytest.param(
        "tp2_sp_etp1_ep2_zero1_hybrid2", 8,
        [*TP2_SP, *EP2, "--expert-tensor-parallel-size", "1", *ZERO1, *HYBRID2],
        id="tp2_sp_etp1_ep2_zero1_hybrid2", marks=pytest.mark.slow,
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def experts_single(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("hybrid_experts"), "single", 1, EXPERTS_MODEL)[0]


@pytest.mark.parametrize("name, nproc, flags", EXPERT_LAYOUTS)
def test_hybrid_sharding_with_the_experts_apart_gives_one_ranks_curve(
    tmp_path, experts_single, name, nproc, flags
):
    got, stdout = curves(tmp_path, name, nproc, [*EXPERTS_MODEL, *flags])
    assert "hybrid: 2 replicas of the state" in stdout and "(experts: ep 2" in stdout
    assert_same(got, experts_single)


@pytest.mark.slow
def test_a_run_with_experts_saved_with_instances_resumes_without_and_back(tmp_path, experts_single):
    hybrid = (4, [*EXPERTS_MODEL, *EP2, *ZERO1, *HYBRID2])
    plain = (2, [*EXPERTS_MODEL, *EP2, *ZERO1])
    layouts.assert_resumes_there_and_back(tmp_path, experts_single, hybrid, plain)
