"""python -m fmeg.check, the layout check of a user's own flags: its plan (what it shrinks, leaves
out and runs), and the check itself on the real runner, passing where the layouts agree and
failing, naming the layout, where a planted bug makes one differ."""

import sys
import textwrap

import pytest

from fmeg.testing.run_check import differences, relative_difference
from fmeg.config import layout_check
from fmeg.config.arguments import parse_args
from harness.megatron_flag_sets import CONFIGS, argv_of
from harness.paths import ROOT
from harness.runner import run_group

DENSE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4"]
MOE_CP = [
    *DENSE,
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--context-parallel-size", "2",
]  # fmt: skip
MLA_MTP = [
    *DENSE,
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8",
    "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--mtp-num-layers", "1",
]  # fmt: skip


def check(*args, env=None, timeout=900):
    return run_group([sys.executable, "-m", "fmeg.check", *args], timeout=timeout, env=env)


def test_the_plan_shrinks_the_model_says_so_and_leaves_out_the_runs_own_layout_and_outputs():
    plan = layout_check.plan(
        [*"--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096".split(),
         *"--tensor-model-parallel-size 8 --save /ck --wandb-project p --bf16".split()],
    )  # fmt: skip
    said = "\n".join(layout_check.describe(plan))
    for line in ("--num-layers 32 -> 4", "--hidden-size 4096 -> 64", "--seq-length 4096 -> 32"):
        assert line in said
    assert "left out --tensor-model-parallel-size" in said and "--save, --wandb-project" in said
    assert "ran in fp32" in said
    reference = parse_args(list(plan.reference.argv))
    assert (reference.num_layers, reference.hidden_size, reference.seq_length) == (4, 64, 32)
    assert reference.save is None and not reference.wandb_project and not reference.bf16
    assert reference.tensor_model_parallel_size == 1 and reference.device == "cpu"
    names = [row.name for row in plan.rows]
    # a dense model: no expert parallelism tried; at most 4 ranks
    assert "tp2" in names and "pp2-vp2" in names and "dp2-zero" in names
    assert not any("ep" in n for n in names) and all(row.world <= 4 for row in plan.rows)
    for row in plan.rows:
        a = parse_args(list(row.argv), world_size=row.world)
        assert a.global_batch_size == reference.global_batch_size == 8


def test_a_muon_plan_runs_newton_schulz_in_fp32_unless_told_to_keep_precision():
    flags = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --optimizer muon".split()
    plan = layout_check.plan(flags)
    assert "Newton-Schulz in fp32" in "\n".join(layout_check.describe(plan))
    assert parse_args(list(plan.reference.argv)).muon_fp32_matmul_prec == "high"
    kept = layout_check.plan(flags, keep_precision=True)
    assert parse_args(list(kept.reference.argv)).muon_fp32_matmul_prec == "medium"


def test_the_plan_keeps_the_model_unshrunk_when_told_and_tries_experts_only_with_experts():
    plan = layout_check.plan([*DENSE, "--seq-length", "64"], shrink=False, max_ranks=2)
    assert not plan.shrank and parse_args(list(plan.reference.argv)).seq_length == 64
    moe = layout_check.plan(MOE_CP, max_ranks=2)
    assert "dp2-ep2" in [row.name for row in moe.rows]


def test_a_config_files_settings_are_given_as_flags_to_every_row(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("num-layers: 8\nhidden-size: 256\ntensor-model-parallel-size: 2\nsave: ck\n")
    plan = layout_check.plan(["--config", str(yaml)], layouts=["dp2"])
    assert "--config" not in plan.rows[0].argv
    row = parse_args(list(plan.rows[0].argv), world_size=2)
    assert (row.num_layers, row.hidden_size, row.tensor_model_parallel_size) == (4, 64, 1)
    assert row.save is None and "left out --save:" in "\n".join(layout_check.describe(plan))


def test_layouts_the_flags_do_not_allow_are_listed_or_refused_when_asked_for():
    plan = layout_check.plan([*DENSE, "--num-layers", "3"], max_ranks=2)
    assert any(line.startswith("pp2: ") for line in plan.not_run)
    with pytest.raises(layout_check.PlanError, match="--layouts pp2: "):
        layout_check.plan([*DENSE, "--num-layers", "3"], layouts=["pp2"])
    with pytest.raises(layout_check.PlanError, match="'tq2' is not a layout part"):
        layout_check.plan(DENSE, layouts=["tq2"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_settings_of_megatron_configurations_round_trip_through_the_command_line(name):
    argv = argv_of(CONFIGS[name])
    try:
        settings = layout_check.given_settings(argv)
    # a flag set fmeg refuses at parse time: nothing to round-trip
    except SystemExit:
        pytest.skip("refused at parse time")
    # every value the runner reads is the same, and so are Megatron's adjustments it names
    kept = ("given", "layout_problems")

    def values(argv):
        return {k: v for k, v in vars(parse_args(argv)).items() if k not in kept}

    assert values(layout_check.argv_of(settings)) == values(argv)


def test_differences_are_relative_and_a_missing_metric_or_iteration_is_infinite():
    want = [{"lm_loss": 2.0, "grad_norm": 1.0, "mtp_1 loss": 3.0, "loss_scale": 1.0}]
    got = [{"lm_loss": 2.002, "grad_norm": 1.0, "loss_scale": 4.0}]
    diffs = differences(got, want)
    assert diffs["lm_loss"] == pytest.approx(1e-3) and diffs["grad_norm"] == 0.0
    assert diffs["mtp_1 loss"] == float("inf") and "loss_scale" not in diffs
    assert differences(got + got, want) == {"iterations": float("inf")}
    assert relative_difference(float("nan"), 1.0) == float("inf")


def test_a_dense_check_prints_its_table_and_passes():
    out = check("--layouts", "tp2,dp2-zero", *DENSE)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert rows["tp2"].endswith("same") and rows["dp2-zero"].endswith("same")
    # each rank's persistent state, in MB: ZeRO-1 slices the optimizer's part over the 2 ranks
    one = float(rows["1"].split()[3])
    zero = [float(x) for x in rows["dp2-zero"].split()[-3:-1]]
    assert len(zero) == 2 and all(0.5 * one < mb < one for mb in zero)
    assert "every layout equals one rank within 1e-05" in out.stdout


def test_a_planted_layout_dependent_bug_fails_the_check_and_names_the_layout(tmp_path):
    # every process imports sitecustomize: it plants a bug in what leaves a tensor-parallel region
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import fmeg.parallel.tensor as tensor

            _leave = tensor.leave

            def leave(x, tp):
                y = _leave(x, tp)
                return y * 1.001 if tp.group is not None else y

            tensor.leave = leave
            """
        )
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = check("--layouts", "tp2,pp2", *DENSE, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert rows["tp2"].endswith("DIFFERS") and rows["pp2"].endswith("same")
    assert "differ from one rank beyond 1e-05: tp2" in out.stderr


def test_bad_layouts_and_flags_are_one_line_and_exit_2():
    out = check("--layouts", "tp2,tq2", *DENSE, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "error: --layouts tq2: 'tq2' is not a layout part (tp<N>, pp<N>, vp<N>, cp<N>, dp<N>, "
        "ep<N>, etp<N>, sp, zero, fsdp joined by '-', e.g. tp2-pp2)"
    ]
    out = check("--num-layers", "0", timeout=120)
    assert out.returncode == 2 and "--num-layers" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [DENSE, MOE_CP, MLA_MTP], ids=["dense", "moe_cp", "mla_mtp"])
def test_each_flag_set_passes_at_every_layout_it_allows(flags):
    out = check(*flags, timeout=3000)
    assert out.returncode == 0, out.stdout + out.stderr
    table = [line for line in out.stdout.splitlines() if line.endswith("same")]
    assert len(table) >= 6, out.stdout
