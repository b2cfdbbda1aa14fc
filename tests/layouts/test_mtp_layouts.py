"""Layout invariance of multi-token prediction with default flags (dropout 0.1 included): a
DeepSeek-V3-shaped model (MLA, sigmoid-routed experts with an expert bias after a dense first layer)
with two MTP depths gives one rank's lm loss, "mtp_1 loss", "mtp_2 loss" and seq_load_balancing_loss
within 1e-5 over 20 iterations at pp 2 with virtual stages (the depths on the last stage, with their
copy of the untied word embedding; and in ZB-V's V, where that stage is on pipeline rank 0), tp 2
with sp, ep 2, cp 2, dp 2 with the distributed optimizer, with packed documents and per-token
losses; a checkpoint saved at one layout resumes at another on its curve."""

import pytest

from harness.runner import DROPOUT, run_recipe
from harness.layouts import MLA, TP2_SP
from harness.layouts import PP2_VIRTUAL, assert_same
from harness import layouts

MTP = [*MLA, *DROPOUT, "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
KEYS = ("lm_loss", "mtp_1 loss", "mtp_2 loss", "seq_load_balancing_loss")
LAYOUTS = layouts.rows(
    [
        "pp2_virtual",
        "tp2_sp",
        "ep2",
        "cp2",
        "dp2_zero1",
        "pp2_tp2_sp",
        "tied_pp2",
        # the depths on the last stage, which the V puts on pipeline rank 0
        "pp2_zero_bubble_v",
    ],
    fast=("pp2_virtual",),
)


def curves(tmp_path, name, nproc, flags):
    records, _ = run_recipe(tmp_path, name, nproc, [*MTP, *flags])
    return {key: [r[key] for r in records if "lm_loss" in r] for key in KEYS}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("mtp"), "single", 1, [])


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_mtp_curves_equal_one_ranks(tmp_path, single, name, nproc, flags):
    if name == "tied_pp2":  # the output layer is the embedding: the depths use it on the last stage
        tied = [f for f in MTP if f != "--untie-embeddings-and-output-weights"]
        one = run_recipe(tmp_path, "one", 1, tied)[0]
        other = run_recipe(tmp_path, "two", 2, [*tied, *flags])[0]
        for key in KEYS:
            a, b = ([r[key] for r in rs if "lm_loss" in r] for rs in (other, one))
            assert_same({key: a}, {key: b})
        return
    assert_same(curves(tmp_path, name, nproc, flags), single)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"],
        ["--calculate-per-token-loss"],
    ],
    ids=["documents", "per_token"],
)
def test_mtp_with_documents_or_per_token_losses_at_cp2_x_pp2_equals_one_rank(tmp_path, extra):
    flags = ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", *extra]
    assert_same(curves(tmp_path, "other", 4, flags), curves(tmp_path, "one", 1, extra))


@pytest.mark.slow
def test_mtp_saved_at_pp2_resumes_at_tp2_on_its_curve(tmp_path, single):
    ckpt = str(tmp_path / "ckpt")
    curves(
        tmp_path,
        "first",
        2,
        [
            *PP2_VIRTUAL,
            "--use-distributed-optimizer",
            "--save",
            ckpt,
            "--train-iters",
            "10",
            "--lr-decay-iters",
            "20",
        ],
    )
    records, stdout = run_recipe(tmp_path, "second", 2, [*MTP, *TP2_SP, "--load", ckpt])
    assert "resumed from" in stdout
    got = {key: [r[key] for r in records if "lm_loss" in r] for key in KEYS}
    assert_same(got, {key: values[10:] for key, values in single.items()}, iterations=10)


def test_an_mtp_checkpoints_model_comes_back_from_its_flags():
    """--use-checkpoint-args: the flags written back from a saved MTP model give the same model."""

    from fmeg.config.arguments import parse_args
    from fmeg.config.checkpoint_args import model_flags
    from fmeg.config.run_config import model_config

    size = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
    a = parse_args(
        [
            "--position-embedding-type",
            "rope",
            "--mtp-num-layers",
            "2",
            "--mtp-loss-scaling-factor",
            "0.3",
            *size,
        ],
        world_size=1,
    )
    saved = model_config(a, 257)
    assert saved.mtp_depth == 2 and saved.mtp.loss_scaling_factor == 0.3
    b = parse_args(size, world_size=1)
    for name, value in model_flags(saved.flat()).items():
        setattr(b, name, value)
    assert model_config(b, 257) == saved
