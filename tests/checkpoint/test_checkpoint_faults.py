"""Surviving faults: SIGKILL during saves never leaves a checkpoint that loads silently wrong;
SIGTERM and exit conditions save and exit cleanly; non-finite steps are skipped and counted, or stop
the run."""

import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from fmeg import checkpoint
from fmeg.checkpoint import safetensors_file
from fmeg.parallel.mesh import Mesh
from fmeg.training.run_state import check_model, read_state
from harness.checkpoints import CONFIG, _Cfg, one_rank_state, save_one
from harness.runner import COMMON
from harness.checkpoints import full_disk_at


def assert_loads_whole(found):
    """Every tensor of the checkpoint reads back and matches its crc32, and the model is the one
    saved."""
    with checkpoint.Checkpoint.open(found) as ckpt:
        check_model(ckpt, CONFIG)
        read_state(ckpt, one_rank_state(), _Cfg(CONFIG), Mesh.single(), optimizer=True)
        assert ckpt.meta["iteration"] == int(found.name.split("_")[1])


def keep_saving(root):
    torch.set_num_threads(1)
    for iteration in range(1, 10_000):
        save_one(root, iteration)


def test_sigkill_at_random_moments_of_saving_never_leaves_a_bad_checkpoint(tmp_path):
    rng = random.Random(0)
    ctx = multiprocessing.get_context("fork")
    for trial in range(20):
        root = tmp_path / f"t{trial}"
        proc = ctx.Process(target=keep_saving, args=(root,))
        proc.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # partial directories are reported with a warning
            found = checkpoint.latest(root) if root.exists() else None
        if found is not None:
            assert_loads_whole(found)


def run(tmp_path, flags, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "recipes.gpt_pretrain", *COMMON, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def test_sigterm_saves_and_exits_zero_within_one_iteration(tmp_path):
    proc = run(
        tmp_path,
        [
            "--train-iters",
            "100000",
            "--exit-signal-handler",
            "--save",
            str(tmp_path / "ck"),
            "--log-interval",
            "1",
        ],
    )
    for line in proc.stdout:  # wait until training has started
        if "iteration        3/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "exiting at iteration" in out and "SIGTERM received" in out
    stopped = int(out.split("exiting at iteration ")[1].split(":")[0])
    assert 3 <= stopped <= 5  # the iteration running when the signal came, or the next
    assert checkpoint.latest(tmp_path / "ck").name == f"iter_{stopped:07d}"


@pytest.mark.slow
def test_sigterm_to_the_workers_under_torchrun_saves_and_every_process_exits_zero(tmp_path):
    """docs/checkpoints.md's way under torchrun: signal torchrun's workers (its children), not
    torchrun; each rank saves its part of one checkpoint and exits 0, and torchrun exits 0."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "recipes.gpt_pretrain",
            *COMMON,
            "--train-iters",
            "100000",
            "--exit-signal-handler",
            "--save",
            str(tmp_path / "ck"),
            "--log-interval",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:  # wait until training has started
        if "iteration        3/" in line:
            break
    workers = subprocess.run(
        ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(int(pid), signal.SIGTERM)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM received" in out and "Traceback" not in out
    latest = checkpoint.latest(tmp_path / "ck")
    assert latest is not None and len(list(latest.glob("*.safetensors"))) == 2


def test_exit_interval_saves_and_stops(tmp_path):
    proc = run(tmp_path, ["--exit-interval", "3", "--save", str(tmp_path / "ck")])
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0 and "exiting at iteration 3: --exit-interval 3" in out
    assert (tmp_path / "ck" / checkpoint.LATEST).read_text() == "3"


def test_non_finite_steps_stop_the_run_by_default_or_are_counted_without_the_check(tmp_path):
    """Megatron's --check-for-nan-in-loss-and-grad is on by default: a non-finite loss stops the run
    (exit 1, one line). With --no-check-for-nan-in-loss-and-grad the run goes on and counts them."""
    # An absurd learning rate drives the weights to inf within a few steps.
    flags = [
        "--lr",
        "1e30",
        "--min-lr",
        "0",
        "--lr-warmup-iters",
        "0",
        "--clip-grad",
        "0",
        "--log-interval",
        "20",
    ]
    proc = run(tmp_path, flags)
    out, _ = proc.communicate(timeout=400)
    assert (
        proc.returncode == 1
        and "error: iteration " in out
        and "--check-for-nan-in-loss-and-grad" in out
    ), out[-2000:]
    for older_name in (["--fail-on-nan"], ["--check-for-nan-in-loss-and-grad"]):
        proc = run(tmp_path, flags + older_name)
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 1 and "non-finite" in out
    proc = run(tmp_path, flags + ["--no-check-for-nan-in-loss-and-grad"])
    out, _ = proc.communicate(timeout=400)
    assert (
        proc.returncode == 0
        and "number of nan iterations:" in out
        and "0 NaN" not in out.split("done:")[1]
    )


@pytest.mark.slow  # the default NaN check stays in the default suite
def test_the_nan_check_stops_a_loss_scaled_run_that_scaling_cannot_save(tmp_path):
    """Under --fp16 an overflow is the scaler's to skip, but a non-finite loss, or an overflow
    already at --min-loss-scale, stops the run with the default check (it used to skip 29 of 30
    iterations and exit 0)."""
    absurd = [
        "--fp16",
        "--lr",
        "1e30",
        "--min-lr",
        "0",
        "--lr-warmup-iters",
        "0",
        "--clip-grad",
        "0",
        "--log-interval",
        "20",
    ]
    proc = run(tmp_path, absurd)
    out, _ = proc.communicate(timeout=400)
    assert (
        proc.returncode == 1
        and "non-finite loss (Megatron's --check-for-nan-in-loss-and-grad" in out
    ), out[-2000:]
    floor = [
        "--fp16",
        "--initial-loss-scale",
        "1e30",
        "--min-loss-scale",
        "1e30",
        "--log-interval",
        "20",
    ]
    proc = run(tmp_path, floor)
    out, _ = proc.communicate(timeout=400)
    assert (
        proc.returncode == 1 and "overflowed at the minimum loss scale 1e+30 (Megatron's" in out
    ), out[-2000:]
    # the scaler skips, the run goes on
    proc = run(tmp_path, floor + ["--no-check-for-nan-in-loss-and-grad"])
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0 and "number of skipped iterations:" in out


SAVES = [*COMMON, "--train-iters", "6", "--save-interval", "2", "--log-interval", "100"]


def test_a_full_disk_fails_in_one_line_and_the_next_run_resumes(tmp_path, monkeypatch, capsys):
    """A save that cannot be written (here the writer reports ENOSPC at iteration 4) ends the run
    with one line naming --save, the size and the free space; the partial directory is gone,
    iteration 2 is intact, and the next run, with space again, resumes from it."""
    from recipes import gpt_pretrain

    real_write = full_disk_at(monkeypatch, 4)
    root = tmp_path / "ck"
    assert gpt_pretrain.main([*SAVES, "--save", str(root)]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert (
        len(errors) == 1
        and f"--save {root}: writing iteration 4 failed ([Errno 28] No space left" in errors[0]
    )
    assert "MiB are free" in errors[0] and "iter_0000002 is intact" in errors[0], errors
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000002",
        "latest_checkpointed_iteration.txt",
    ]
    monkeypatch.setattr(safetensors_file, "write", real_write)
    assert gpt_pretrain.main([*SAVES, "--save", str(root), "--load", str(root)]) == 0
    assert checkpoint.latest(root).name == "iter_0000006"


def test_keep_last_makes_room_before_saving_when_space_is_short(tmp_path, monkeypatch, capsys):
    from recipes import gpt_pretrain

    from fmeg.training import run_state

    monkeypatch.setattr(
        run_state.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 0)
    )
    root = tmp_path / "ck"
    assert gpt_pretrain.main([*SAVES, "--save", str(root), "--keep-last", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        f"removed {root / 'iter_0000002'} before saving: the disk is short of space for "
        "--keep-last 2" in out
    )
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000004", "iter_0000006"]


def test_exit_duration(tmp_path):
    proc = run(tmp_path, ["--exit-duration-in-mins", "0", "--save", str(tmp_path / "ck")])
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0 and "exiting at iteration 1: --exit-duration-in-mins 0" in out


def test_a_dead_runs_partial_save_never_breaks_a_restart_at_another_world_size(tmp_path):
    """A 4-rank save killed at iteration 4 left iter_0000004.tmp-<token> with its rank files (and
    the older fixed-name iter_0000004.tmp). A 2-rank restart removes both at start, writes its own
    temporary directory, and its final checkpoint holds exactly its 2 ranks' files."""
    from harness.runner import run_recipe

    ck = tmp_path / "ck"
    for leftover in ("iter_0000004.tmp-deadbeef0000", "iter_0000004.tmp"):
        (ck / leftover).mkdir(parents=True)
        for rank in range(4):
            (ck / leftover / f"rank_{rank:05d}.json").write_text("{}")
            (ck / leftover / f"rank_{rank:05d}.safetensors").write_bytes(b"partial")
    records, stdout = run_recipe(tmp_path, "restart", 2, ["--train-iters", "4", "--save", str(ck)])
    assert len(records) == 4 and stdout.count("an interrupted save's leftovers") == 2
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000004", checkpoint.LATEST]
    assert sorted(p.name for p in (ck / "iter_0000004").iterdir()) == [
        "metadata.json",
        "rank_00000.json",
        "rank_00000.safetensors",
        "rank_00001.json",
        "rank_00001.safetensors",
    ]


def test_a_load_path_that_is_an_iteration_or_has_a_bad_pointer_is_one_line(
    trained_checkpoint, tmp_path
):
    """--load naming iter_0000030 (not its parent) would otherwise train from scratch in silence,
    and a garbled latest pointer would end in a traceback."""
    iteration = str(checkpoint.latest(trained_checkpoint))
    flags = [
        "--train-iters",
        "2",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "recipes.gpt_pretrain", *flags, "--load", iteration],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 2 and "is one iteration of a checkpoint" in out.stderr, out.stderr[
        -2000:
    ]
    assert len(out.stderr.strip().splitlines()) == 1
    shutil.copytree(trained_checkpoint, tmp_path / "ck")
    (tmp_path / "ck" / checkpoint.LATEST).write_text("thirty\n")
    for recipe in (["recipes.gpt_pretrain", *flags], ["recipes.generate", "--prompt", "x"]):
        out = subprocess.run(
            [sys.executable, "-m", *recipe, "--load", str(tmp_path / "ck")],
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert out.returncode == 2 and "not an iteration number" in out.stderr, out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1


def test_keep_last_and_cleanup_touch_only_what_fmeg_wrote(tmp_path):
    """Pruning and the removal of dead runs' leftovers take names that are exactly fmeg's
    (iter_NNNNNNN and iter_NNNNNNN.tmp-<token>); a user's copy beside them, a file and a symlink
    stay."""
    from recipes import gpt_pretrain

    root = tmp_path / "ck"
    root.mkdir()
    (root / "iter_0000004.bak").mkdir()
    (root / "iter_0000004.bak" / "notes.txt").write_text("mine")
    (root / "iter_0000001").write_text("a file with a checkpoint's name")
    (root / "iter_0000003").symlink_to(root / "iter_0000004.bak")
    (root / "iter_0000002.tmp-backup").mkdir()
    assert gpt_pretrain.main([*SAVES, "--save", str(root), "--keep-last", "2"]) == 0
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000001",
        "iter_0000002.tmp-backup",
        "iter_0000003",
        "iter_0000004",
        "iter_0000004.bak",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert (root / "iter_0000004.bak" / "notes.txt").read_text() == "mine" and (
        root / "iter_0000003"
    ).is_symlink()


def test_settings_outside_the_shapes_may_change_on_load_and_shapes_may_not(tmp_path, capsys):
    """As Megatron: a run may load a checkpoint with other dropout (or init, RoPE base) and says so
    in one warning line; a change of a parameter's shape is still refused in one line."""
    from recipes import gpt_pretrain

    root = tmp_path / "ck"
    assert (
        gpt_pretrain.main(
            [*SAVES, "--save", str(root), "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
        )
        == 0
    )
    capsys.readouterr()
    assert gpt_pretrain.main([*SAVES, "--load", str(root), "--finetune", "--train-iters", "3"]) == 0
    out = capsys.readouterr().out
    for change in ("hidden_dropout 0.1 -> 0.0", "attention_dropout 0.1 -> 0.0"):
        assert (
            out.count(f"warning: --load {root}: {change} (a setting outside the parameters' shapes")
            == 1
        ), out
    assert (
        gpt_pretrain.main([*SAVES, "--load", str(root), "--finetune", "--ffn-hidden-size", "64"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "the checkpoint's model differs from the flags in ffn_hidden_size" in err[0]
    ), err
