"""Each group of flags checks itself (problems()), and the run still reports every problem at
once: a group's own lines and the lines of checks across groups together."""

import pytest

from fmeg.config.arguments import GROUPS, parse_args
from fmeg.config.model_flags import ModelFlags
from fmeg.config.training_flags import OptimizerFlags, TrainingFlags
from fmeg.config.validation import validate


def test_defaults_have_no_problems():
    assert [line for cls in GROUPS for line in cls().problems()] == []


def test_a_group_names_each_of_its_problems_by_flag():
    assert OptimizerFlags(lr=-1.0, adam_beta2=1.0, clip_grad=-2.0).problems() == [
        "--lr must be positive, got -1.0",
        "--min-lr 0.0 must be between 0 and --lr -1.0",
        "--clip-grad must be >= 0, got -2.0",
        "--adam-beta2 must be in [0, 1), got 1.0",
    ]
    assert ModelFlags(hidden_dropout=1.5, ffn_hidden_size=0).problems() == [
        "--ffn-hidden-size must be positive, got 0",
        "--hidden-dropout must be in [0, 1), got 1.5",
    ]
    assert TrainingFlags(train_samples=3, train_iters=0).problems() == [
        "--train-samples 3 is less than one global batch; raise it"
    ]


def test_the_run_reports_group_and_layout_problems_together():
    argv = ["--lr", "-1", "--tensor-model-parallel-size", "3"]
    lines = validate(parse_args(argv, world_size=4), world_size=4)
    assert "--lr must be positive, got -1.0" in lines
    assert any(line.startswith("world size 4 must be divisible") for line in lines), lines


def test_a_size_that_is_not_positive_stops_the_checks_across_groups():
    lines = validate(parse_args(["--num-layers", "0", "--lr", "2"], world_size=1), world_size=1)
    assert lines == ["--num-layers must be positive, got 0"]


def test_the_v_schedules_name_their_needs():
    v = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    argv = [*v, "--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "dualpipe_v"]
    batch = ["--micro-batch-size", "1", "--global-batch-size", "3"]
    lines = validate(parse_args([*argv, *batch], world_size=2), world_size=2)
    assert lines == [
        "--pipeline-schedule dualpipe_v needs at least 2 x --pipeline-model-parallel-size (4) "
        "microbatches per step, got 3; raise --global-batch-size"
    ]
    enough = ["--micro-batch-size", "1", "--global-batch-size", "4"]
    assert validate(parse_args([*argv, *enough], world_size=2), world_size=2) == []
    three = [*v[:2], "--num-layers", "6", "--num-virtual-stages-per-pipeline-rank", "3"]
    lines = validate(parse_args([*three, "--pipeline-schedule", "zero_bubble_v"], 2), 2)
    assert lines[0].startswith("--pipeline-schedule zero_bubble_v places two stages on each")


@pytest.mark.parametrize("schedule", ["zero_bubble_v", "dualpipe_v"])
def test_the_v_schedules_take_their_two_virtual_stages_unasked(schedule):
    """Both V schedules need exactly two virtual stages per rank: the plain command sets them and
    says so at start (issue 67: it was refused until --num-virtual-stages-per-pipeline-rank 2)."""
    argv = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    argv += ["--pipeline-schedule", schedule, "--micro-batch-size", "1", "--global-batch-size", "4"]
    a = parse_args(argv, world_size=2)
    assert validate(a, world_size=2) == []
    assert a.num_virtual_stages_per_pipeline_rank == 2
    assert a.num_layers_per_virtual_pipeline_stage == 1
    assert (
        f"--pipeline-schedule {schedule} places two stages on each pipeline rank in a V: "
        "--num-virtual-stages-per-pipeline-rank 2 set"
    ) in a.notices
