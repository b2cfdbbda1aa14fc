"""Layout invariance of multi-latent attention with default flags otherwise: a DeepSeek-V3-shaped
model (MLA with a query latent, YaRN, latent norms; sigmoid-routed experts with an expert bias and a
shared expert after a dense first layer) gives one rank's loss curve and seq_load_balancing_loss
within 1e-5 over 20 iterations at tp 2 with sp, pp 2 with virtual stages, ep 2, cp 2 (each comm
type: the values are padded to the query head size there), dp 2 with the distributed optimizer, with
packed documents, recomputation and compilation."""

import pytest

from harness.runner import run_recipe
from harness.layouts import MLA, TP2_SP
from harness import layouts

DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
# all -m slow; tests/parallel/test_parallel_gpt.py checks MLA under tp in the default suite
LAYOUTS = layouts.rows(
    [
        "tp2_sp",
        "pp2_virtual",
        "ep2",
        "cp2",
        "cp2_a2a",
        "cp2_allgather",
        "dp2_zero1",
        "ep2_tp2_sp_zero1",
        "recompute_selective_compiled",
        "recompute_modules_tp2_sp_compiled",
    ],
    fast=(),
)


def curves(tmp_path, name, nproc, flags):
    records, _ = run_recipe(tmp_path, name, nproc, [*MLA, *flags])
    return {
        key: [r[key] for r in records if "lm_loss" in r]
        for key in ("lm_loss", "seq_load_balancing_loss")
    }


def assert_same(got, want):
    for key in want:
        assert len(got[key]) == len(want[key]) == 20
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], want[key])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("mla"), "single", 1, [])


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_mla_curves_equal_one_ranks(tmp_path, single, name, nproc, flags):
    assert_same(curves(tmp_path, name, nproc, flags), single)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, flags", [(2, ["--context-parallel-size", "2"]), (2, TP2_SP)], ids=["cp2", "tp2_sp"]
)
def test_mla_with_packed_documents_equals_one_rank(tmp_path, nproc, flags):
    assert_same(
        curves(tmp_path, "other", nproc, [*DOCUMENTS, *flags]),
        curves(tmp_path, "one", 1, DOCUMENTS),
    )


@pytest.mark.slow
def test_mla_saved_at_tp2_zero1_resumes_at_one_rank_on_its_curve(tmp_path, single):
    ckpt = str(tmp_path / "ckpt")
    curves(
        tmp_path,
        "first",
        2,
        [
            *TP2_SP,
            "--use-distributed-optimizer",
            "--save",
            ckpt,
            "--train-iters",
            "10",
            "--lr-decay-iters",
            "20",
        ],
    )
    records, stdout = run_recipe(tmp_path, "second", 1, [*MLA, "--load", ckpt])
    assert "resumed from" in stdout
    got = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert len(got) == 10
    for a, b in zip(got, single["lm_loss"][10:]):
        assert abs(a - b) <= 1e-5 * abs(b), (got, single["lm_loss"])


def test_an_mla_checkpoints_model_comes_back_from_its_flags():
    """--use-checkpoint-args: the flags written back from a saved MLA model give the same model."""

    from fmeg.config.arguments import parse_args
    from fmeg.config.checkpoint_args import model_flags
    from fmeg.config.run_config import model_config

    a = parse_args(
        [*MLA, "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"],
        world_size=1,
    )
    saved = model_config(a, 257)
    b = parse_args(
        ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2"], world_size=1
    )
    for name, value in model_flags(saved.flat()).items():
        setattr(b, name, value)
    b.num_experts, b.moe_ffn_hidden_size, b.moe_layer_freq = (
        a.num_experts,
        a.moe_ffn_hidden_size,
        a.moe_layer_freq,
    )
    for name in (
        "moe_router_topk",
        "moe_router_score_function",
        "moe_router_enable_expert_bias",
        "moe_router_topk_scaling_factor",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_shared_expert_intermediate_size",
        "moe_router_dtype",
    ):
        setattr(b, name, getattr(a, name))
    assert model_config(b, 257) == saved
