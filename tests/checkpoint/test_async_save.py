"""--async-save: the state is copied to host memory and written by a background thread while
training goes on. The curve and the files are those of synchronous saving; a process killed
(SIGKILL) at any moment of a background write never leaves a checkpoint that --load would choose and
cannot read; a background write that fails ends the run in one line, the previous checkpoint intact;
--ckpt-fully-parallel-load resumes bitwise too."""

import random
import signal
import subprocess
import sys
import time
import warnings

import pytest

from fmeg import checkpoint
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.training.run_state import check_model, read_state
from harness.runner import COMMON, run_layout, run_recipe
from harness.checkpoints import _Cfg, one_rank_state


def files_of(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != "metadata.json"}


def test_async_saves_give_the_synchronous_curve_and_files(tmp_path):
    flags = ["--save-interval", "5", "--use-distributed-optimizer", "--bf16"]
    sync = run_layout(tmp_path, "sync", 2, [*flags, "--save", str(tmp_path / "sync")])
    background, stdout = run_recipe(
        tmp_path, "async", 2, [*flags, "--async-save", "--save", str(tmp_path / "async")]
    )
    assert [r["lm_loss"] for r in background] == sync
    assert stdout.count("(written in the background)") == 4  # iterations 5, 10, 15, 20
    for iteration in (5, 10, 15, 20):
        name = f"iter_{iteration:07d}"
        assert files_of(tmp_path / "sync" / name) == files_of(tmp_path / "async" / name)
    resumed = run_layout(
        tmp_path,
        "resumed",
        2,
        [
            "--load",
            str(tmp_path / "async"),
            "--train-iters",
            "20",
            "--use-distributed-optimizer",
            "--bf16",
        ],
    )
    assert resumed == []  # iteration 20 was saved: nothing is left to train


def assert_loads_whole(found):
    with checkpoint.Checkpoint.open(found) as ckpt:
        config = gpt.GPTConfig(**ckpt.meta["model"])
        check_model(ckpt, config)
        read_state(ckpt, one_rank_state(config), _Cfg(config), Mesh.single(), optimizer=True)


BIG = [
    "--hidden-size",
    "256",
    "--num-layers",
    "4",
    "--train-iters",
    "100000",
    "--save-interval",
    "1",
    "--async-save",
    "--log-interval",
    "1",
]


def kill_during_background_writes(tmp_path, trials: int, seed: int = 0) -> int:
    """Runs that save every iteration in the background, each SIGKILLed at a random moment once
    saving has begun; returns how many kills left a write unfinished."""
    rng, mid_write = random.Random(seed), 0
    for trial in range(trials):
        root = tmp_path / f"t{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "recipes.gpt_pretrain", *COMMON, *BIG, "--save", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for line in proc.stdout:
            if "saved checkpoint" in line:
                break
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        mid_write += any(root.glob("iter_*.tmp*"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unfinished write is reported with a warning
            found = checkpoint.latest(root)
        assert found is not None
        assert_loads_whole(found)
    return mid_write


def test_sigkill_during_background_writes_never_leaves_a_checkpoint_load_chooses_and_cannot_read(
    tmp_path,
):
    kill_during_background_writes(tmp_path, 3)


@pytest.mark.slow
def test_twenty_sigkills_during_background_writes(tmp_path):
    assert kill_during_background_writes(tmp_path, 20, seed=1) >= 5  # most kills land in a write


def test_a_background_write_that_fails_ends_the_run_in_one_line_and_keeps_the_previous(
    tmp_path, monkeypatch, capsys
):
    from recipes import gpt_pretrain
    from harness.checkpoints import full_disk_at

    full_disk_at(monkeypatch, 4)
    root = tmp_path / "ck"
    flags = [
        *COMMON,
        "--train-iters",
        "8",
        "--save-interval",
        "2",
        "--async-save",
        "--save",
        str(root),
    ]
    assert gpt_pretrain.main(flags) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert (
        len(errors) == 1
        and f"--save {root}: writing iteration 4 failed ([Errno 28] No space left" in errors[0]
    )
    assert "iter_0000002 is intact" in errors[0], errors
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", checkpoint.LATEST]


def test_fully_parallel_load_resumes_bitwise(tmp_path):
    """dp 2 without the distributed optimizer: each rank reads half of every buffer (weights, Adam's
    moments) and all-gathers the other half."""
    ckpt = tmp_path / "ck"
    full = run_layout(tmp_path, "full", 2, [])
    run_layout(
        tmp_path, "first", 2, ["--save", str(ckpt), "--train-iters", "10", "--lr-decay-iters", "20"]
    )
    assert (
        run_layout(tmp_path, "second", 2, ["--load", str(ckpt), "--ckpt-fully-parallel-load"])
        == full[10:]
    )


def test_the_exit_interval_and_sigterm_wait_for_the_background_save(tmp_path):
    """Saving every iteration in the background: --exit-interval 3 exits 0 with iteration 3's
    checkpoint complete, and so does SIGTERM under --exit-signal-handler, at the iteration it stops
    after."""
    from recipes import gpt_pretrain

    root = tmp_path / "interval"
    flags = [*COMMON, "--async-save", "--save-interval", "1"]
    assert gpt_pretrain.main([*flags, "--exit-interval", "3", "--save", str(root)]) == 0
    assert checkpoint.latest(root).name == "iter_0000003"
    assert_loads_whole(checkpoint.latest(root))
    root = tmp_path / "sigterm"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recipes.gpt_pretrain",
            *flags,
            "--train-iters",
            "100000",
            "--exit-signal-handler",
            "--log-interval",
            "1",
            "--save",
            str(root),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    for line in proc.stdout:
        if "iteration        3/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    stopped = int(out.split("exiting at iteration ")[1].split(":")[0])
    assert proc.returncode == 0 and checkpoint.latest(root).name == f"iter_{stopped:07d}", out[
        -2000:
    ]
    assert_loads_whole(checkpoint.latest(root))
