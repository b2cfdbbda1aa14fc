"""python -m fmeg.launch (torchrun with the workers' exit passed through): bad input on 2 ranks is
one line and exit 2 with no traceback of torchrun's; SIGTERM to the launcher saves and exits 0; a
killed rank takes the job down within 10 s in one line; SIGKILLs during saves, with restarts at
another world size, always resume from the newest complete checkpoint."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import pytest

from fmeg import checkpoint
from harness.runner import COMMON
from harness.processes import wait_for

LAUNCH = [sys.executable, "-m", "fmeg.launch", "--standalone"]


def launch(nproc, flags, **kwargs):
    return subprocess.Popen(
        [*LAUNCH, f"--nproc-per-node={nproc}", "-m", "recipes.gpt_pretrain", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def assert_one_line(proc, needle, code=2, timeout=400):
    out, err = proc.communicate(timeout=timeout)
    lines = err.strip().splitlines()
    assert (
        proc.returncode == code
        and len(lines) == 1
        and lines[0].startswith("error: ")
        and needle in lines[0]
    ), (proc.returncode, out[-1000:], err[-3000:])
    return out


def test_a_refused_input_is_not_restarted(tmp_path):
    """--max-restarts 2 with a bad flag: the refusal is final (one line, exit 2), no restart line,
    no other cause named (the agent's SIGTERM to the slower rank is not one)."""
    proc = subprocess.Popen(
        [
            *LAUNCH,
            "--nproc-per-node=2",
            "--max-restarts",
            "2",
            "-m",
            "recipes.gpt_pretrain",
            "--adam-beta1",
            "2",
            "--log-dir",
            str(tmp_path / "log"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out = assert_one_line(proc, "--adam-beta1 must be in [0, 1), got 2.0")
    assert "restarting" not in out and "SIGTERM" not in out


def test_bad_input_on_two_ranks_is_one_line_and_exit_2(tmp_path):
    """A flag error, a YAML error and a missing tokenizer file: rank 0 prints one line, every rank
    exits 2, and the launcher exits 2 with nothing of its own, before any log or checkpoint
    exists."""
    config = tmp_path / "run.yaml"
    config.write_text("fp16: 'no'\n")
    cases = [
        (["--adam-beta1", "2"], "--adam-beta1 must be in [0, 1), got 2.0"),
        (["--config", str(config)], "fp16: 'no' is not true or false"),
        (
            [
                "--tokenizer-type",
                "Llama2Tokenizer",
                "--tokenizer-model",
                str(tmp_path / "none.model"),
            ],
            "none.model",
        ),
    ]
    procs = [
        launch(
            2, [*flags, "--log-dir", str(tmp_path / f"log{i}"), "--save", str(tmp_path / f"ck{i}")]
        )
        for i, (flags, _) in enumerate(cases)
    ]
    for i, (proc, (_, needle)) in enumerate(zip(procs, cases)):
        assert_one_line(proc, needle)
        assert not (tmp_path / f"log{i}").exists() and not (tmp_path / f"ck{i}").exists()


REFUSING = """
import os, sys, time
from fmeg.cli import print_refusal
rank = int(os.environ["RANK"])
if rank in {who}:
    # rank 0 slowest: the launcher stops it when another rank exits
    time.sleep({delay} if rank == 0 else 0)
    print_refusal(["--data-path d: bad on " + ("rank 1" if {who} == {{1}} else "every rank")])
    sys.exit(2)
time.sleep(60)
"""


@pytest.mark.parametrize("who, needle", [({1}, "bad on rank 1"), ({0, 1}, "bad on every rank")])
def test_a_refusal_is_printed_once_whichever_rank_exits_first(tmp_path, who, needle):
    """Under fmeg.launch each refusal is printed once, by the first rank to reach it: a problem only
    rank 1 meets is not lost (rank 0 printed alone before), nor is one every rank meets when rank 0
    is the slowest and is stopped before it prints (1 run in 19 ended with exit 2 and no line)."""
    script = tmp_path / "refusing.py"
    script.write_text(REFUSING.format(who=who, delay=5))
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc-per-node=2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert_one_line(proc, needle, timeout=120)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_and_exits_zero(tmp_path):
    proc = launch(
        2,
        [
            *COMMON,
            "--train-iters",
            "100000",
            "--exit-signal-handler",
            "--save",
            str(tmp_path / "ck"),
            "--log-interval",
            "1",
        ],
    )
    wait_for(proc, "iteration        3/")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0 and err.strip() == "" and "SIGTERM received" in out, (
        out[-2000:],
        err[-2000:],
    )
    latest = checkpoint.latest(tmp_path / "ck")
    assert latest is not None and len(list(latest.glob("*.safetensors"))) == 2


def workers_of(proc) -> list[int]:
    return [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
    ]


@pytest.mark.slow
def test_a_killed_rank_takes_the_job_down_within_10_seconds_in_one_line(tmp_path):
    proc = launch(2, [*COMMON, "--train-iters", "100000", "--log-interval", "1"])
    wait_for(proc, "iteration        3/")
    workers = workers_of(proc)
    assert len(workers) == 2, workers
    killed = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - killed
    assert took < 10, took
    assert proc.returncode == 128 + signal.SIGKILL, (proc.returncode, err[-2000:])
    assert (
        "error: rank 1 was killed by SIGKILL; the other ranks were stopped" in err
        and "Traceback" not in err
    )
    assert all(not os.path.exists(f"/proc/{pid}") for pid in workers)
    print(f"a killed rank took the job down in {took:.2f} s")


def complete(path) -> bool:
    """Whether a final checkpoint directory holds exactly its metadata and the files it lists,
    verified."""
    meta = json.loads((path / "metadata.json").read_text())
    expected = {"metadata.json", *meta["files"]} | {
        f"rank_{r:05d}.json" for r in range(meta["world_size"])
    }
    return {p.name for p in path.iterdir()} == expected


@pytest.mark.slow
def test_sigkill_during_saves_twenty_times_with_restarts_at_another_world_size(tmp_path):
    """Every iteration saves; the whole job (launcher and workers) is SIGKILLed at a random moment,
    20 times, each restart at another world size (1 and 2 alternating). Each restart resumes from
    the newest complete checkpoint the last kill left, and no final checkpoint holds a stray
    file."""
    rng, ckpt = random.Random(0), tmp_path / "ck"
    flags = [
        *COMMON,
        "--train-iters",
        "100000",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "1",
        "--log-interval",
        "1",
    ]
    resumed_at, mid_save = [], 0
    for trial in range(20):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unfinished directories are reported with a warning
            newest = checkpoint.latest(ckpt) if ckpt.exists() else None
        proc = launch(1 + trial % 2, flags)
        lines = wait_for(proc, "saved checkpoint")
        said = "".join(lines)
        if newest is not None:
            assert f"resumed from {newest}" in said, said[-2000:]
            resumed_at.append(int(newest.name.split("_")[1]))
        time.sleep(rng.uniform(0.0, 1.5))
        # torchrun's workers live in sessions of their own
        for pid in [proc.pid, *workers_of(proc)]:
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        mid_save += any(ckpt.glob("iter_*.tmp*"))  # the kill interrupted a save
        for final in ckpt.glob("iter_???????"):
            assert complete(final), sorted(p.name for p in final.iterdir())
    assert len(resumed_at) == 19 and resumed_at == sorted(resumed_at)
    assert mid_save >= 3, mid_save


def runner_bad_inputs(tmp_path) -> list[tuple[str, int, list[str], str]]:
    """(name, ranks, flags, the error's words) for every runner case of
    tests/training/test_gpt_pretrain.py: bad flags, bad data files and bad YAML, each on at least 2
    ranks."""
    from harness.bad_input import BAD, BAD_DATA, YAML_CASES, _dataset, malformed_tokenizer_files

    cases = [
        (f"flags{i}", max(2, int(env["WORLD_SIZE"])), flags, needle)
        for i, (env, flags, needle) in enumerate(BAD)
    ]
    for name, (documents, extra, needle) in BAD_DATA.items():
        prefix = _dataset(
            tmp_path / ("big" if name == "ids_past_vocab" else name),
            documents,
            extra_bin_bytes=extra,
        )
        cases.append(
            (
                name,
                2,
                [
                    "--data-path",
                    prefix,
                    "--seq-length",
                    "16",
                    "--global-batch-size",
                    "2",
                    "--micro-batch-size",
                    "1",
                    "--tensor-model-parallel-size",
                    "2",
                ],
                needle,
            )
        )
    for i, (text, needle) in enumerate(YAML_CASES):
        (tmp_path / f"run{i}.yaml").write_text(text)
        cases.append((f"yaml{i}", 2, ["--config", str(tmp_path / f"run{i}.yaml")], needle))
    (tmp_path / "a_file").write_text("")
    for flag in ("--save", "--tensorboard-dir", "--data-cache-path"):
        cases.append(
            (
                f"output{flag}",
                2,
                [flag, str(tmp_path / "a_file" / "out")],
                "a_file is a file, so no directory",
            )
        )
    for i, (flags, needle) in enumerate(malformed_tokenizer_files(tmp_path)):
        cases.append((f"tokenizer{i}", 2, flags, needle))
    return cases


@pytest.mark.slow
def test_every_runner_bad_input_under_the_launcher_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """The bad-input suite's runner cases (59), each on 2 ranks or its world size under python -m
    fmeg.launch: exit 2, exactly one line on stderr, naming the flag or file, no traceback, no log
    directory written."""
    monkeypatch.setenv("FMEG_CACHE", str(tmp_path / "cache"))
    cases = runner_bad_inputs(tmp_path)
    assert len(cases) >= 59
    failures, running = [], []

    def finish(name, needle, log, proc):
        out, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        if not (
            proc.returncode == 2
            and len(lines) == 1
            and lines[0].startswith("error: ")
            and needle in lines[0]
            and "Traceback" not in out + err
            and not log.exists()
        ):
            failures.append((name, proc.returncode, err[-600:]))

    for name, ranks, flags, needle in cases:  # three jobs at a time
        log = tmp_path / f"log_{name}"
        running.append((name, needle, log, launch(ranks, [*flags, "--log-dir", str(log)])))
        if len(running) == 3:
            finish(*running.pop(0))
    for job in running:
        finish(*job)
    assert not failures, failures


LAUNCHER_BAD = [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: give a positive number"),
    (["--nproc-per-node", "abc"], "--nproc-per-node abc: give a positive number"),
    (["--master-port", "99999"], "--master-port 99999: a port is a number from 1 to 65535"),
    (["--nnodes", "0"], "--nnodes 0: give a positive number of nodes"),
    (["--nnodes", "3:2"], "--nnodes 3:2: give a positive number of nodes"),
    (["--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
] + (
    [(["--nproc-per-node", "gpu"], "--nproc-per-node gpu: no GPU is visible")]
    if not __import__("torch").cuda.is_available()
    else []
)


@pytest.mark.parametrize("flags, needle", LAUNCHER_BAD, ids=[c[1][:30] for c in LAUNCHER_BAD])
def test_the_launchers_own_bad_flags_are_one_line(tmp_path, flags, needle):
    proc = subprocess.Popen(
        [*LAUNCH, *flags, "-m", "recipes.gpt_pretrain", "--log-dir", str(tmp_path / "log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert_one_line(proc, needle)
    assert not (tmp_path / "log").exists()


@pytest.mark.slow
def test_two_sigterms_during_a_save_still_exit_zero_with_the_checkpoint(tmp_path):
    """A second SIGTERM 0.3 s after the first (a scheduler's repeat) is ignored once the run is
    exiting on the first: the checkpoint is complete and the job exits 0 (it used to report a killed
    rank, exit 143)."""
    proc = launch(
        2,
        [
            *COMMON,
            "--train-iters",
            "100000",
            "--exit-signal-handler",
            "--save",
            str(tmp_path / "ck"),
            "--log-interval",
            "1",
        ],
    )
    wait_for(proc, "iteration        3/")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0 and err.strip() == "" and "SIGTERM received" in out, (
        out[-2000:],
        err[-2000:],
    )
    latest = checkpoint.latest(tmp_path / "ck")
    assert latest is not None and complete(latest)
