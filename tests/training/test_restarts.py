"""A job that loses a rank carries on by itself: under python -m fmeg.launch --max-restarts N, a
rank killed with SIGKILL at a random iteration restarts the group, which resumes from the newest
complete checkpoint under --save (no flag changes: no --load) and ends on the uninterrupted run's
final loss, bitwise; a rank stopped with SIGSTOP is named in one line once the others' collectives
time out (--distributed-timeout-minutes), and the job ends or restarts."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from harness.runner import COMMON
from harness.processes import wait_for

LAUNCH = [sys.executable, "-m", "fmeg.launch", "--standalone", "--nproc-per-node=2"]
RUN = [*COMMON, "--train-iters", "24", "--save-interval", "4", "--log-interval", "1"]


def launch(flags, restarts=0):
    return subprocess.Popen(
        [*LAUNCH, f"--max-restarts={restarts}", "-m", "recipes.gpt_pretrain", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def workers(proc) -> list[int]:
    return [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
    ]


def final_loss(log_dir) -> tuple[int, float]:
    last = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()][-1]
    return last["iteration"], last["lm_loss"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = launch([*RUN, "--save", str(tmp / "ck"), "--log-dir", str(tmp / "log")])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return final_loss(tmp / "log")


def killed_and_restarted(tmp_path, kill_at: int, extra=()) -> tuple[tuple[int, float], str]:
    """SIGKILL one worker (at random) once iteration kill_at is logged; the job must finish by
    itself."""
    proc = launch(
        [*RUN, *extra, "--save", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "log")],
        restarts=2,
    )
    wait_for(proc, f"iteration {kill_at:8d}/")
    os.kill(random.Random(kill_at).choice(workers(proc)), signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out[-2000:], err[-2000:])
    assert "restarting the workers (1 of 2): rank " in out and "was killed by SIGKILL" in out, out[
        -2000:
    ]
    return final_loss(tmp_path / "log"), out


def test_a_rank_killed_mid_run_restarts_the_job_which_ends_on_the_uninterrupted_loss(
    tmp_path, uninterrupted
):
    """Killed after iteration 9 is logged: the restart resumes from iteration 8's checkpoint by
    itself."""
    loss, out = killed_and_restarted(tmp_path, 9)
    assert loss == uninterrupted
    assert f"restart 1: resuming from --save {tmp_path / 'ck'}" in out and "(iteration 8," in out, (
        out[-3000:]
    )


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_random_kill_points_with_async_saves_end_on_the_uninterrupted_loss_bitwise(
    tmp_path, uninterrupted, seed
):
    """Five random iterations (some during a background save), each killing a random rank."""
    kill_at = random.Random(seed).randint(2, 22)
    assert killed_and_restarted(tmp_path, kill_at, ["--async-save"])[0] == uninterrupted, kill_at


def test_a_stopped_rank_is_named_in_one_line_once_the_others_time_out(tmp_path):
    """--distributed-timeout-minutes 0.2: the other rank gives up after 12 s, a roll call through
    torchrun's store finds the silent rank, one line names it, and the stopped process is killed at
    once (not after torchrun's 30 s grace): the job ends within the timeout and the 5 s roll
    call."""
    proc = launch(
        [
            *COMMON,
            "--train-iters",
            "100000",
            "--log-interval",
            "1",
            "--distributed-timeout-minutes",
            "0.2",
        ]
    )
    wait_for(proc, "iteration        3/")
    pids = workers(proc)
    stopped = max(pids)
    os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, err[-3000:])
    assert (
        lines[0].startswith("error: rank ")
        and "stopped answering" in lines[0]
        and "12 s" in lines[0]
    ), lines
    assert took < 12 + 5 + 8, took
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    print(f"a stopped rank ended the job {took:.1f} s after SIGSTOP: {lines[0]}")


@pytest.mark.slow
def test_a_restarted_fine_tuning_job_resumes_its_own_checkpoint_not_the_one_it_started_from(
    tmp_path,
):
    """--load A --finetune --save B: the first start takes A's weights at iteration 0; after a kill,
    the restart resumes B's newest checkpoint as it is (iteration, optimizer), not A again."""
    base = tmp_path / "pretrained"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.gpt_pretrain",
            *COMMON,
            "--train-iters",
            "4",
            "--save",
            str(base),
        ],
        check=True,
        capture_output=True,
    )
    flags = [
        *RUN,
        "--load",
        str(base),
        "--finetune",
        "--save",
        str(tmp_path / "ck"),
        "--log-dir",
        str(tmp_path / "log"),
    ]
    proc = launch(flags, restarts=1)
    first = "".join(wait_for(proc, f"iteration {10:8d}/"))
    os.kill(random.Random(0).choice(workers(proc)), signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    out = first + out
    assert proc.returncode == 0, (out[-2000:], err[-2000:])
    assert (
        "fine-tuning from" in out and f"resumed from {tmp_path / 'ck' / 'iter_0000008'}" in out
    ), out[-3000:]
    assert final_loss(tmp_path / "log")[0] == 24
