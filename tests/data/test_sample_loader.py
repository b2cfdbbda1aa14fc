"""--num-workers: the next iteration's samples are built on worker threads while a step runs; what
is built is what the training thread would build, so the loss curve is the same bitwise with 0
workers or several."""

from __future__ import annotations

import threading

from fmeg.training.sample_loader import SampleLoader


def test_samples_are_built_ahead_on_workers_and_equal_what_is_built_when_asked():
    where = {}

    def build(dataset, first):
        where[first] = threading.current_thread().name
        return [dataset[i] for i in range(first, first + 2)]

    data = list(range(100))
    loader = SampleLoader(2, build)
    loader.ahead(data, [0, 4, 8])
    assert loader.get(data, [0, 4, 8]) == [[0, 1], [4, 5], [8, 9]]
    assert all(where[f].startswith("fmeg-samples") for f in (0, 4, 8))
    loader.ahead(data, [10])
    # not the one ahead
    assert loader.get(data, [20]) == [[20, 21]] and where[20] == threading.current_thread().name
    assert loader.get(data, [10]) == [[10, 11]]  # nothing pending any more: built when asked
    loader.close()
    alone = SampleLoader(0, build)
    alone.ahead(data, [30])
    assert 30 not in where and alone.get(data, [30]) == [[30, 31]]


def test_the_curve_does_not_depend_on_the_workers(tmp_path):
    from harness.runner import run_recipe

    flags = [
        "--train-iters",
        "6",
        "--reset-attention-mask",
        "--reset-position-ids",
        "--mock-data",
        "--seq-length",
        "32",
    ]
    none, _ = run_recipe(tmp_path, "none", 1, [*flags, "--num-workers", "0"])
    four, _ = run_recipe(tmp_path, "four", 1, [*flags, "--num-workers", "4"])
    assert [r["lm_loss"] for r in none] == [r["lm_loss"] for r in four] and len(none) == 6


def test_negative_workers_are_one_line(tmp_path, monkeypatch):
    from harness.bad_input import assert_one_line_exit_2_nothing_left

    assert_one_line_exit_2_nothing_left(
        tmp_path, monkeypatch, "gpt_pretrain", ["--num-workers", "-1"], "--num-workers must be >= 0"
    )
