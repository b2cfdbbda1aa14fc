"""Layout invariance of a mixture of experts with default flags otherwise: the loss curve and the
logged load-balancing and z losses at expert parallelism 2 and 4 (with either token dispatcher), ep
2 x tp 2 with sp (the experts' tensor parallelism 2 and 1), ep 2 x pp 2 with virtual stages, ep 2 x
dp 2, tp 2 with sp, pp 2 with virtual stages and dp 2 with the distributed optimizer equal one
rank's within 1e-5 over 20 iterations (the balance losses' gradients join at each layer, with the
seed the pipeline's loss backward starts from; the experts' gradients are averaged over
expert-data-parallel ranks). A checkpoint saved at ep 4 resumes at ep 1, ep 2 and tp 2 x ep 2, and
one saved at ep 2 with the distributed optimizer (the experts' Adam state sliced over expert_dp) at
its own layout and at ep 2 without it, on the same curve."""

import pytest

from harness.runner import run_recipe
from harness import layouts

# Mixtral-style routing (top-2 of 4 experts, aux loss, z-loss) on a DeepSeek-style layer pattern (a
# dense first layer) with a shared expert.
MOE = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-z-loss-coeff",
    "0.001",
    "--moe-layer-freq",
    "([0]+[1]*3)",
    "--swiglu",
    "--ffn-hidden-size",
    "16",
    "--moe-ffn-hidden-size",
    "8",
    "--moe-shared-expert-intermediate-size",
    "8",
]
EP2, TP2_SP = (
    ["--expert-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
)
A2A = ["--moe-token-dispatcher-type", "alltoall"]
CP2 = [
    "--context-parallel-size",
    "2",
    # the balance losses' parts over the sequence's cp chunks; tokens travel by the uneven
    # all-to-all
]
PP2_VIRTUAL = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
LAYOUTS = layouts.rows(
    [
        "ep2",
        "ep4",
        "ep2_tp2_sp",
        "ep2_pp2_virtual",
        "ep2_dp2",
        "ep2_dp2_zero1",
        "ep2_tp2_sp_etp1",
        "tp2_sp_etp1",
        "ep2_tp2_sp_etp1_zero1",
        "ep2_tp2_sp_compiled",
        "compiled",
        "recompute_full",
        "recompute_selective",
        "pp2_virtual",
        "tp2_sp",
        "dp2_zero1",
        "ep2_alltoall",
        "ep4_alltoall",
        "ep2_tp2_sp_etp1_alltoall",
        "ep2_pp2_virtual_alltoall",
        "ep2_dp2_zero1_alltoall",
        "ep2_compiled_alltoall",
        "ep2_flex",
        "cp2",
        "cp2_ep2",
        "cp2_ep2_zero1_alltoall",
        "cp2_tp2_sp_ep2_etp1",
        # the experts' weight gradients deferred to W
        "ep2_pp2_zero_bubble_v",
        "pp2_dualpipe_v",
    ],
    fast=("ep2", "pp2_virtual"),
)
NAMES = ("lm_loss", "load_balancing_loss", "z_loss")


def curves(tmp_path, name, nproc, flags):
    records, _ = run_recipe(tmp_path, name, nproc, [*MOE, *flags])
    return {key: [r[key] for r in records if "lm_loss" in r] for key in NAMES}


def assert_same(got, want, first=0):
    for key in NAMES:
        assert len(got[key]) == len(want[key]) - first
        for a, b in zip(got[key], want[key][first:]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], want[key])


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("moe"), "single", 1, [])


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_moe_curves_and_balance_losses_are_layout_invariant(
    tmp_path, moe_reference, name, nproc, flags
):
    got = curves(tmp_path, name, nproc, flags)
    assert len(got["lm_loss"]) == 20
    assert_same(got, moe_reference)


EP4 = ["--expert-model-parallel-size", "4"]
ZERO = ["--use-distributed-optimizer"]


@pytest.mark.parametrize(
    "save_flags, nproc, flags",
    [
        pytest.param(EP4, 1, [], marks=pytest.mark.slow),
        pytest.param(EP4, 2, EP2, marks=pytest.mark.slow),
        pytest.param(EP4, 4, [*EP2, *TP2_SP], marks=pytest.mark.slow),
        pytest.param([*EP2, *ZERO], 4, [*EP2, *ZERO], marks=pytest.mark.slow),
        pytest.param([*EP2, *ZERO], 2, EP2, marks=pytest.mark.slow),
        pytest.param(
            [*EP2, *TP2_SP, "--expert-tensor-parallel-size", "1", *ZERO],
            2,
            TP2_SP,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            [*EP2, *TP2_SP, "--expert-tensor-parallel-size", "1"],
            4,
            [*EP2, *TP2_SP, "--expert-tensor-parallel-size", "1"],
            marks=pytest.mark.slow,
        ),
        pytest.param([*CP2, *EP2, *ZERO], 2, EP2, marks=pytest.mark.slow),
    ],
    ids=[
        "ep4_to_ep1",
        "ep4_to_ep2",
        "ep4_to_ep2_tp2_sp",
        "ep2_zero1_same_layout",
        "ep2_zero1_to_ep2_dp1",
        "ep2_tp2_etp1_zero1_to_tp2",
        "ep2_tp2_etp1_same_layout",
        "cp2_ep2_zero1_to_ep2",
    ],
)
def test_a_checkpoint_resumes_at_its_own_or_another_expert_layout_on_the_same_curve(
    tmp_path, moe_reference, save_flags, nproc, flags
):
    ckpt = str(tmp_path / "ckpt")
    curves(
        tmp_path,
        "first",
        4,
        [*save_flags, "--save", ckpt, "--train-iters", "10", "--lr-decay-iters", "20"],
    )
    got = curves(tmp_path, "second", nproc, [*flags, "--load", ckpt])
    assert_same(got, moe_reference, first=10)


def test_the_balance_losses_change_the_training(tmp_path, moe_reference):
    """The injected gradients act: without the aux and z losses the curve differs."""
    records, _ = run_recipe(
        tmp_path, "no_aux", 1, [*MOE, "--moe-aux-loss-coeff", "0", "--moe-z-loss-coeff", "0"]
    )
    plain = [r["lm_loss"] for r in records if "lm_loss" in r]
    # same model, same first batch
    assert plain[0] == pytest.approx(moe_reference["lm_loss"][0], rel=1e-6)
    assert abs(plain[-1] - moe_reference["lm_loss"][-1]) > 1e-4
    assert "load_balancing_loss" not in records[0] and "z_loss" not in records[0]


# DeepSeek-V3's routing without MLA and MTP: sigmoid scores, the aux-loss-free expert bias,
# group-limited top-4 of 8, a scaling factor, a shared expert, a sequence-level balance loss and a
# dense first layer.
DEEPSEEK = [
    "--num-experts",
    "8",
    "--moe-router-topk",
    "4",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "1e-3",
    "--moe-router-num-groups",
    "4",
    "--moe-router-group-topk",
    "2",
    "--moe-router-topk-scaling-factor",
    "2.5",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-aux-loss-coeff",
    "1e-4",
    "--moe-shared-expert-intermediate-size",
    "16",
    "--moe-layer-freq",
    "([0]+[1]*3)",
    "--moe-ffn-hidden-size",
    "8",
    "--swiglu",
    "--ffn-hidden-size",
    "32",
    "--moe-router-dtype",
    "fp32",
]


def test_a_deepseek_v3_style_model_trains_saves_at_ep2_and_resumes_at_ep1_on_one_ranks_curve(
    tmp_path,
):
    """The expert bias moves by +-rate per step as Megatron's does (from the step's tokens per
    expert over every rank), is saved with the weights, and the run resumed at another ep follows
    one rank's curve."""
    from safetensors.torch import load_file

    def run(name, nproc, flags):
        records, _ = run_recipe(tmp_path, name, nproc, [*DEEPSEEK, *flags])
        # logged under megatron-core's name for seq_aux_loss
        assert "load_balancing_loss" not in records[0]
        return [r["lm_loss"] for r in records], [r["seq_load_balancing_loss"] for r in records]

    single = run("single", 1, [])
    ckpt = tmp_path / "ckpt"
    run(
        "first",
        2,
        [
            "--expert-model-parallel-size",
            "2",
            "--save",
            str(ckpt),
            "--train-iters",
            "10",
            "--lr-decay-iters",
            "20",
        ],
    )
    second = run("second", 1, ["--load", str(ckpt)])
    for got, want in zip(second, single):
        assert len(got) == 10 and all(
            abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want[10:])
        ), (got, want)
    bias = [
        t
        for f in (ckpt / "iter_0000010").glob("*.safetensors")
        for n, t in load_file(str(f)).items()
        if n.startswith("params/") and ".expert_bias[" in n
    ]
    assert bias and all(t.abs().max() > 0 for t in bias)
    # ten steps of +-1e-3 (or 0 at an exact tie): multiples of the rate, at most 1e-2
    for t in bias:
        steps = t / 1e-3
        assert (steps - steps.round()).abs().max() < 1e-3 and t.abs().max() <= 1e-2 + 1e-6


@pytest.mark.parametrize(
    "nproc, flags",
    [
        # tests/models/test_moe.py: the sp rows
        pytest.param(2, ["--expert-model-parallel-size", "2"], marks=pytest.mark.slow),
        pytest.param(
            2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], marks=pytest.mark.slow
        ),
    ],
    ids=["ep2", "tp2_sp"],
)
def test_forced_load_balancing_routes_as_one_rank_does(tmp_path, nproc, flags):
    """Megatron's benchmarking switch --moe-router-force-load-balancing: random router logits, keyed
    by each token's place, so the curve and the balance loss are one rank's at any layout; with
    random routing every expert gets tokens, and the balance loss sits near its balanced value (1
    for seq_aux_loss)."""

    def run(name, n, extra):
        records, _ = run_recipe(
            tmp_path, name, n, [*DEEPSEEK, "--moe-router-force-load-balancing", *extra]
        )
        return [(r["lm_loss"], r["seq_load_balancing_loss"]) for r in records if "lm_loss" in r]

    single, other = run("single", 1, []), run("other", nproc, flags)
    assert len(single) == len(other) == 20
    for (a, x), (b, y) in zip(other, single):
        assert abs(a - b) <= 1e-5 * abs(b) and abs(x - y) <= 1e-5 * abs(y), (other, single)
    assert all(abs(balance - 1.0) < 0.5 for _, balance in single)


GLOBAL = ["--moe-router-load-balancing-type", "global_aux_loss"]


@pytest.mark.parametrize(
    "nproc, flags",
    [
        pytest.param(2, EP2, marks=pytest.mark.slow),
        pytest.param(4, TP2_SP, marks=pytest.mark.slow),
        pytest.param(4, PP2_VIRTUAL, marks=pytest.mark.slow),
        pytest.param(4, CP2, marks=pytest.mark.slow),
        pytest.param(4, [*EP2, *TP2_SP, *ZERO], marks=pytest.mark.slow),
    ],
    ids=["ep2", "tp2_sp", "pp2_virtual", "cp2", "ep2_tp2_sp_zero1"],
)
def test_global_aux_loss_curves_equal_data_parallel_2s_at_any_other_layout(tmp_path, nproc, flags):
    """global_aux_loss counts every data rank's tokens, averaged over the step's microbatches so
    far: by its definition it depends on dp and the microbatches, so the reference is dp 2 (2
    ranks); tp, sp, pp, cp and ep over the same two data ranks give its curve and its
    global_load_balancing_loss."""

    def run(name, n, more):
        records, stdout = run_recipe(tmp_path, name, n, [*MOE, *GLOBAL, *more])
        return {
            key: [r[key] for r in records if "lm_loss" in r]
            for key in ("lm_loss", "global_load_balancing_loss", "z_loss")
        }, stdout

    want, stdout = run("dp2", 2, [])
    assert (
        "global_load_balancing_loss" in stdout and 0.5 < want["global_load_balancing_loss"][0] < 2.0
    )
    got, _ = run("other", nproc, flags)
    for key in want:
        assert len(got[key]) == 20
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], want[key])


# uneven loss masks: the aux losses' scale shows
PER_TOKEN = ["--calculate-per-token-loss", "--eod-mask-loss"]


@pytest.mark.slow
def test_per_token_balance_losses_are_layout_invariant_with_uneven_masks(tmp_path):
    """Megatron's per-token scaling of the balance losses (each router's tokens, masked or not) at
    ep 2 x tp 2 with sp, cp 2 x ep 2 and pp 2 with virtual stages: one rank's curve."""
    want = curves(tmp_path, "single_per_token", 1, PER_TOKEN)
    for name, nproc, flags in [
        ("ep2_tp2_sp", 4, [*EP2, *TP2_SP]),
        ("cp2_ep2", 4, [*CP2, *EP2]),
        ("pp2_virtual", 2, PP2_VIRTUAL),
    ]:
        assert_same(curves(tmp_path, name, nproc, [*PER_TOKEN, *flags]), want)
