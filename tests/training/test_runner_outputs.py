"""What the runner writes: the same scalars to metrics.jsonl, TensorBoard and Weights & Biases
(offline); Megatron's log line unchanged into a file, with a progress line (ETA, tokens/s) after it;
a progress bar on a terminal; and flags that now mean what current Megatron means (a static
--loss-scale, a step batch-size schedule)."""

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from harness.runner import COMMON, run_recipe

LOG_LINE = re.compile(
    r"^ iteration +\d+/ +\d+ \| consumed samples: +\d+ \| elapsed time per iteration \(ms\): "
    r"[\d.]+ \| (throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| )?learning rate: [\d.E+-]+ \| "
    r"global "
    r"batch size: +\d+ \| lm loss: [\d.E+-]+ \| loss scale: [\d.]+ \| grad norm: [\d.]+ \| number "
    r"of skipped iterations: +\d+ \| number of nan iterations: +\d+ \|$"
)


def wandb_history(path) -> list[dict]:
    """The history rows of an offline .wandb file, read without wandb's service: a 7-byte header,
    then LevelDB-log blocks of 32 KiB holding records (crc32c, length, type full/first/middle/last)
    of wandb's Record protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, rows, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0 and length == 0:  # the block's padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                        for i in record.history.item
                    }
                )
    return rows


def test_tensorboard_and_wandb_get_the_scalars_of_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    records, _ = run_recipe(
        tmp_path,
        "sinks",
        1,
        [
            "--train-iters",
            "6",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--tensorboard-dir",
            str(tmp_path / "tb"),
            "--wandb-project",
            "fmeg-test",
            "--wandb-exp-name",
            "sinks",
            "--wandb-save-dir",
            str(tmp_path / "wb"),
        ],
    )
    train = [r for r in records if "lm_loss" in r]
    valid = [r for r in records if "validation_lm_loss" in r]
    assert len(train) == 6 and len(valid) == 2
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = wandb_history(runs[0])
    logged = {
        (row["_step"], key): value
        for row in history
        for key, value in row.items()
        if not key.startswith("_")
    }
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for names, key in (("lm loss", "lm_loss"), ("grad norm", "grad_norm"), ("lr", "lr")):
        want = [(r["iteration"], r[key]) for r in train]
        assert [(s.step, pytest.approx(s.value, rel=1e-6)) for s in events.Scalars(names)] == want
        assert [(i, logged[(i, names)]) for i, _ in want] == [
            (i, pytest.approx(v, rel=1e-12)) for i, v in want
        ]
    want = [(r["iteration"], r["validation_lm_loss"]) for r in valid]
    assert [(i, logged[(i, "validation lm loss")]) for i, _ in want] == [
        (i, pytest.approx(v)) for i, v in want
    ]


def test_a_missing_wandb_package_is_one_line(tmp_path, monkeypatch, capsys):
    import builtins

    from recipes import gpt_pretrain

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.setenv("RANK", "0")
    assert gpt_pretrain.main(["--wandb-project", "p"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        'error: --wandb-project p needs the wandb package: pip install wandb (or "fmeg[wandb]")'
    ]


def test_into_a_file_the_log_lines_are_megatrons_with_a_progress_line_after(tmp_path):
    _, stdout = run_recipe(tmp_path, "file", 1, ["--train-iters", "6", "--log-interval", "3"])
    lines = stdout.splitlines()
    logged = [i for i, line in enumerate(lines) if line.startswith(" iteration")]
    assert len(logged) == 2 and all(LOG_LINE.match(lines[i]) for i in logged), lines
    for i in logged:
        assert lines[i + 1].startswith("    timers (ms): ")
        assert re.fullmatch(
            r"    progress: [36]/6 iterations, ETA \d+:\d\d:\d\d, [\d,]+ tokens/s", lines[i + 2]
        )
    assert "\r" not in stdout


def test_on_a_terminal_a_progress_bar_shows_the_eta(tmp_path):
    pytest.importorskip("tqdm")
    leader, follower = pty.openpty()
    # a terminal 200 columns wide
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "recipes.gpt_pretrain",
            *COMMON,
            "--train-iters",
            "30",
            "--log-interval",
            "10",
        ],
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    out, deadline = b"", time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        os.close(leader)
    text = out.decode(errors="replace")
    assert re.search(r"\d+/30 \[.*ETA \d+:\d\d:\d\d, [\d,]+ tokens/s", text), text[-3000:]
    # the bar redraws in place instead of a progress line
    assert "\r" in text and "progress:" not in text
    logged = [
        line.strip("\r") for line in text.replace("\r\n", "\n").split("\n") if " iteration " in line
    ]
    assert len([line for line in logged if LOG_LINE.match(line.split("\r")[-1])]) == 3, logged


def test_a_static_loss_scale_is_kept_every_step(tmp_path):
    records, _ = run_recipe(
        tmp_path, "static", 1, ["--fp16", "--loss-scale", "8192", "--train-iters", "6"]
    )
    assert [r["loss_scale"] for r in records] == [8192.0] * 6 and not any(
        r["skipped"] for r in records
    )


def test_step_batch_size_schedule_trains_with_megatrons_batch_at_each_step(tmp_path):
    """'0:4 640:8' in tokens at --seq-length 16 is 4 samples a step until 40 samples are consumed,
    then 8 (Megatron's StepBatchsizeNumMicroBatchesCalculator); --global-batch-size is ignored, with
    a warning."""
    from harness.steps import megatron_step_batch

    records, stdout = run_recipe(
        tmp_path, "steps", 2, ["--step-batch-size-schedule", "0:4 640:8", "--train-iters", "14"]
    )
    consumed = 0
    for r in records:
        assert r["global_batch_size"] == megatron_step_batch("0:4 640:8", 16, consumed)
        consumed += r["global_batch_size"]
        assert r["consumed_samples"] == consumed
    assert [r["global_batch_size"] for r in records] == [4] * 10 + [8] * 4
    assert "warning: --global-batch-size 8 is ignored with --step-batch-size-schedule" in stdout


def test_tensorboard_and_wandb_take_the_aux_losses_and_per_layer_values_by_megatrons_names():
    from fmeg.training.metrics import scalars

    record = {
        "iteration": 3,
        "lm_loss": 2.0,
        "load_balancing_loss": 1.1,
        "seq_load_balancing_loss_layer_2": 1.2,
        "z_loss_layer_0": 0.5,
        "mtp_1 loss": 2.5,
        "skipped": False,
        "timers_ms": {"data": 1.0},
    }
    assert scalars(record) == {
        "lm loss": 2.0,
        "load_balancing_loss": 1.1,
        "moe/seq_load_balancing_loss_layer_2": 1.2,
        "moe/z_loss_layer_0": 0.5,
        "mtp_1 loss": 2.5,
    }


def test_the_final_line_counts_this_run_and_a_cpu_logs_no_tflops(tmp_path):
    """After a resume, done: counts this run's iterations and samples, and the totals apart (it
    mixed this run's iterations with all samples); a CPU's log line leaves out TFLOP/s per GPU,
    which means nothing there (every CPU line said 0.0)."""
    flags = [
        "--train-iters",
        "4",
        "--save",
        str(tmp_path / "ck"),
        "--save-interval",
        "4",
        "--log-interval",
        "1",
    ]
    _, first = run_recipe(tmp_path, "first", 1, flags)
    assert "done: 4 iterations, 32 samples in " in first and "in all)" not in first
    flags = ["--train-iters", "6", "--load", str(tmp_path / "ck"), "--log-interval", "1"]
    _, second = run_recipe(tmp_path, "second", 1, flags)
    done = next(line for line in second.splitlines() if line.startswith("done: "))
    assert (
        done.startswith("done: 2 iterations, 16 samples in ")
        and "(iteration 6, 48 samples in all)" in done
    )
    logged = [
        line for line in first.splitlines() + second.splitlines() if line.startswith(" iteration")
    ]
    assert len(logged) == 6 and not any("TFLOP/s" in line for line in logged)
