"""Uneven pipeline stages, and zero-bubble's split backward, keep one rank's loss curve (20
iterations, within 1e-5, dropout on as by default): Megatron's --decoder-first-pipeline-num-layers,
--account-for-embedding/loss-in-pipeline-split, and layout strings with stages of 0, 1 and 2
layers, the embedding alone, an empty stage and the loss alone, under 1F1B, interleaved and
zero-bubble schedules, with tp 2 + sp and the distributed optimizer, compiled; zero-bubble with
Megatron-FSDP's sharded weights and compiled (where B computes the weight gradients); multi-token
prediction's layout with its MTP layers beside the loss; a checkpoint saved at uneven stages
resumes at even ones and back on its curve."""

import pytest

from harness import layouts
from harness.layouts import MLA, TP2_SP, assert_same
from harness.runner import DROPOUT, run_recipe

LAYOUTS = layouts.rows(
    [
        "pp2_first1",
        "pp3_embedding_loss_split",
        "pp2_uneven_layout",
        "pp2_uneven_zero_bubble",
        "pp2_uneven_layout_tp2_sp_zero1",
        "pp2_uneven_layout_compiled",
        "pp2_zero_bubble_compiled",
        "pp2_zero_bubble_dp2_fsdp",
    ],
    fast=("pp2_uneven_layout",),
)
V_LAYOUTS = layouts.rows(
    [
        "pp2_zero_bubble_v",
        "pp2_zero_bubble_v_dp2_fsdp",
        "pp2_zero_bubble_v_uneven",
        "pp2_dualpipe_v_tp2_sp",
        "pp2_dualpipe_v_compiled",
    ],
    fast=("pp2_zero_bubble_v", "pp2_dualpipe_v_tp2_sp"),
)


def curves(tmp_path, name, nproc, flags, keys=("lm_loss",)):
    records, stdout = run_recipe(tmp_path, name, nproc, [*DROPOUT, *flags])
    return {key: [r[key] for r in records if "lm_loss" in r] for key in keys}, stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("uneven"), "single", 1, [])[0]


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_uneven_stages_give_one_ranks_curve(tmp_path, single, name, nproc, flags):
    got, stdout = curves(tmp_path, name, nproc, flags)
    stages = {
        "pp2_first1": "1|3",
        "pp3_embedding_loss_split": "1|2|1",
        "pp2_uneven_zero_bubble": "1|3",
        "pp2_zero_bubble_compiled": "2|2",
        "pp2_zero_bubble_dp2_fsdp": "2|2",
    }.get(name, "0|1|2|0|1|0")
    if "zero_bubble" in name and "uneven" not in name:  # even stages: the start line's stage line
        assert f"pipeline stages (per microbatch on one rank of each): layers {stages};" in stdout
        assert_same(got, single)
        return
    assert f"layers per stage {stages}" in stdout
    assert f"pipeline stages (per microbatch on one rank of each): layers {stages};" in stdout
    assert_same(got, single)


@pytest.mark.parametrize("name, nproc, flags", V_LAYOUTS)
def test_v_schedules_give_one_ranks_curve(tmp_path, single, name, nproc, flags):
    """ZB-V and DualPipeV place stages 0 and 3 on pipeline rank 0 (which computes the loss and
    sends it to the last rank, which logs it) and 1 and 2 on rank 1."""
    got, stdout = curves(tmp_path, name, nproc, flags)
    stages = "0|2|1|1" if "uneven" in name else "1|1|1|1"
    assert "(x2 virtual, in a V)" in stdout
    assert f"pipeline stages (per microbatch on one rank of each): layers {stages};" in stdout
    assert_same(got, single)


MTP = [*MLA, "--mtp-num-layers", "1"]
KEYS = ("lm_loss", "mtp_1 loss", "seq_load_balancing_loss")


@pytest.mark.slow
def test_multi_token_prediction_beside_the_loss_on_an_uneven_layout_gives_one_ranks_curves(
    tmp_path,
):
    layout = ["--pipeline-model-parallel-layout", "E|t|tt||t|mL"]
    got, _ = curves(
        tmp_path, "pp2", 2, [*MTP, "--pipeline-model-parallel-size", "2", *layout], KEYS
    )
    assert_same(got, curves(tmp_path, "one", 1, MTP, KEYS)[0])


@pytest.mark.slow
def test_a_run_saved_at_uneven_stages_resumes_at_even_ones_and_back_on_its_curve(tmp_path, single):
    uneven = (2, ["--pipeline-model-parallel-size", "2", *layouts.UNEVEN_LAYOUT])
    layouts.assert_resumes_there_and_back(tmp_path, single, uneven, (2, TP2_SP))


@pytest.mark.slow
def test_a_run_saved_in_a_v_resumes_at_the_loop_and_back_on_its_curve(tmp_path, single):
    """Rank 0 holds stages 0 and 3 in the V, stages 0 and 2 in Megatron's loop."""
    virtual = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    layouts.assert_resumes_there_and_back(
        tmp_path, single, (2, layouts.TABLE["pp2_zero_bubble_v"][1]), (2, virtual)
    )


def test_validation_in_a_v_gives_one_ranks_validation_loss(tmp_path):
    """Evaluation runs forward only through the V (stage 3's loss on pipeline rank 0, sent to the
    last rank, which logs it)."""
    evaluation = ["--eval-interval", "10", "--eval-iters", "2"]

    def validation(name, nproc, flags):
        records, _ = run_recipe(tmp_path, name, nproc, [*DROPOUT, *evaluation, *flags])
        return [r["validation_lm_loss"] for r in records if "validation_lm_loss" in r]

    want = validation("one", 1, [])
    got = validation("v", 2, layouts.TABLE["pp2_dualpipe_v_compiled"][1][:-1])
    assert len(want) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want))
    assert len(got) == 2
