"""python -m fmeg.check, the layout check of a user's own flags: its plan (what it shrinks, leaves
out and runs), and the check itself on the real runner, passing where the layouts agree and
failing, naming the layout, where a planted bug makes one differ."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

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


def test_the_plan_shrinks_the_schedule_with_the_iterations_and_names_each_flag():
    long_run = "--lr-warmup-iters 2000 --train-iters 500000".split()
    plan = layout_check.plan([*DENSE, *long_run], iterations=20)
    said = "\n".join(layout_check.describe(plan))
    assert "--train-iters 500000 -> 20" in said and "--lr-warmup-iters 2000 -> 0" in said
    reference = parse_args(list(plan.reference.argv))
    assert (reference.train_iters, reference.lr_warmup_iters) == (20, 0)
    # the same fractions of the run: warmup 5%, decay 80%
    cosine = "--lr-warmup-iters 50 --lr-decay-iters 800 --train-iters 1000".split()
    reference = parse_args(list(layout_check.plan([*DENSE, *cosine], iterations=20).reference.argv))
    assert (reference.lr_warmup_iters, reference.lr_decay_iters) == (1, 16)
    # a schedule in samples becomes one in iterations
    samples = "--lr-warmup-samples 10000 --lr-decay-samples 90000 --train-samples 100000".split()
    plan = layout_check.plan([*DENSE, *samples], iterations=10)
    said = "\n".join(layout_check.describe(plan))
    assert "--lr-decay-samples 90000 -> --lr-decay-iters 9" in said
    assert "--lr-warmup-samples 10000 -> --lr-warmup-iters 1" in said
    reference = parse_args(list(plan.reference.argv))
    assert (reference.train_iters, reference.lr_warmup_iters, reference.lr_decay_iters) == (
        10,
        1,
        9,
    )
    assert reference.train_samples is None and reference.lr_decay_samples is None


def test_a_dense_check_prints_its_table_and_progress_and_passes():
    # a Megatron-sized schedule: the check runs 5 iterations of it and says so
    long_run = ["--lr-warmup-iters", "2000", "--train-iters", "500000"]
    out = check("--layouts", "tp2,dp2-zero", *DENSE, *long_run)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--train-iters 500000 -> 5; --lr-warmup-iters 2000 -> 0" in out.stdout
    # a line on stderr as each layout starts and ends, with an estimate of the rest
    progress = out.stderr.strip().splitlines()
    assert progress[0] == "[1/3] running 1 rank ...", out.stderr
    assert re.fullmatch(
        r"\[1/3\] 1 rank done; \d+ s so far, about \d+ s left; "
        r"\[2/3\] running tp2 on 2 ranks \.\.\.",
        progress[1],
    ), progress
    assert re.fullmatch(r"\[3/3\] dp2-zero done; \d+ s so far", progress[-1]), progress
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


@pytest.mark.parametrize(
    "options, needle",
    [
        (["--iterations", "0"], "--iterations must be at least 1, got 0"),
        (["--tolerance", "nan"], "--tolerance must be a finite number >= 0, got nan"),
        (["--tolerance", "-1"], "--tolerance must be a finite number >= 0, got -1"),
        (["--max-ranks", "0"], "--max-ranks must be at least 2"),
        (["--max-ranks", "-1"], "--max-ranks must be at least 2"),
        (["--timeout", "0"], "--timeout must be a number of seconds above 0, got 0"),
        (["--layouts", "tp2-pp2-dp2"], "--layouts tp2-pp2-dp2: 8 ranks, above --max-ranks 4"),
        (["--layouts", "tp4-pp2-cp16-dp8", "--max-ranks", "8"], "1024 ranks, above --max-ranks 8"),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tmp}/none.json"],
            "--tokenizer-model {tmp}/none.json: no such file",
        ),
    ],
    ids=lambda v: "_".join(v) if isinstance(v, list) else None,
)
def test_the_checks_own_bad_options_are_one_line_and_exit_2_before_any_run(
    options, needle, tmp_path, capsys
):
    from fmeg import check as fmeg_check

    argv = [o.replace("{tmp}", str(tmp_path)) for o in [*options, *DENSE]]
    assert fmeg_check.main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("error:") == 1, out.err
    assert needle.replace("{tmp}", str(tmp_path)) in out.err
    assert list(tmp_path.iterdir()) == []


def test_help_shows_the_defaults_without_importing_torch():
    program = "import sys; from fmeg import check; check.main(['--help'])"
    out = subprocess.run(
        [sys.executable, "-c", program + "\n"], capture_output=True, text=True, timeout=60
    )
    assert "(default: 5)" in out.stdout and "(default: 1e-05)" in out.stdout, out
    program = (
        "import sys\nfrom fmeg import check\ntry:\n    check.main(['--help'])\n"
        "except SystemExit:\n    print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert out.stdout.strip().endswith("False"), out


def test_sigterm_and_ctrl_c_stop_every_rank_and_leave_no_directory_behind(tmp_path):
    """A stopped check kills the running layout's launcher and its ranks (each torchrun worker is in
    a session of its own) and removes its temporary directories: one line, 128 + the signal."""
    from fmeg.testing.processes import _descendants

    def stopped_at(wanted: str, sig: int):
        proc = subprocess.Popen(
            [sys.executable, "-m", "fmeg.check", "--layouts", "tp2", *DENSE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        try:
            for line in proc.stderr:
                if wanted in line:
                    break
            # the ranks have started when the launcher has children of its own
            deadline = time.time() + 120
            while time.time() < deadline and len(_descendants(proc.pid)) < (3 if sig == 15 else 1):
                time.sleep(0.2)
            tree = _descendants(proc.pid)
            assert tree, "nothing was running"
            proc.send_signal(sig)
            code = proc.wait(timeout=60)
            err = proc.stderr.read()
        finally:
            proc.kill()
        # a SIGKILLed process is gone once its parent or init has reaped it
        deadline = time.time() + 20
        while time.time() < deadline and any(map(running, tree)):
            time.sleep(0.2)
        return code, err, [pid for pid in tree if running(pid)]

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    code, err, alive = stopped_at("running tp2 on 2 ranks", signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and alive == [], (code, err, alive)
    assert err.strip().splitlines() == [
        "error: stopped by SIGTERM; the running layout's ranks were stopped"
    ]
    code, err, alive = stopped_at("[1/2] running 1 rank", signal.SIGINT)
    assert code == 130 and alive == [] and "Traceback" not in err, (code, err, alive)
    assert err.strip().endswith("error: stopped by Ctrl-C; the running layout's ranks were stopped")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("flags", [DENSE, MOE_CP, MLA_MTP], ids=["dense", "moe_cp", "mla_mtp"])
def test_each_flag_set_passes_at_every_layout_it_allows(flags):
    out = check(*flags, timeout=3000)
    assert out.returncode == 0, out.stdout + out.stderr
    table = [line for line in out.stdout.splitlines() if line.endswith("same")]
    assert len(table) >= 6, out.stdout
