"""The runner's decisions as units, without processes: the run configuration, resuming, the exit
policy, the batch and LR schedules in samples and in iterations, fp16's skip accounting, the NaN
policy, and the parser where it now reads flags as Megatron's does."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.data.tokenizers import NullTokenizer
from fmeg.optim import loss_scale
from fmeg.config.arguments import parse_args
from fmeg.config.validation import validate
from fmeg.config.batch_schedule import global_batch_size, iterations_for, parse_step_schedule
from fmeg.training.policies import (
    Progress,
    exit_reasons,
    non_finite_stop,
    resume,
    should_evaluate,
    should_save,
)
from fmeg.config.run_config import RunConfig
from harness.steps import megatron_step_batch

META = {
    "iteration": 40,
    "consumed_samples": 320,
    "valid_consumed_samples": 16,
    "scheduler_steps": 38,
    "loss_scale": dataclasses.asdict(loss_scale.LossScale(scale=1024.0, clean_steps=7)),
}


def config(argv, world=1, vocab=257) -> RunConfig:
    a = parse_args(argv, world_size=world)
    assert validate(a, world) == []
    return RunConfig.from_args(a, world, vocab)


def test_the_run_configuration_is_frozen_groups_with_one_layout():
    cfg = config(
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "16",
            "--use-distributed-optimizer",
            "--bf16",
        ],
        world=8,
    )
    layout = cfg.layout
    assert (layout.tp, layout.pp, layout.chunks, layout.dp, layout.zero) == (2, 2, 2, 2, True)
    assert layout.microbatches(cfg.global_batch) == 16 // (4 * 2)
    assert layout.checkpoint_meta(cfg.precision.compute_dtype) == {
        "tp": 2,
        "pp": 2,
        "chunks": 2,
        "dp": 2,
        "zero": True,
        "dtype": "bfloat16",
    }
    assert cfg.model.padded_vocab_size == 512 and cfg.precision.scaler is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.train_iters = 5
    assert cfg.with_changes(training={"train_iters": 5}).training.train_iters == 5


def test_resume_with_everything_continues_the_run():
    plan = resume(
        META, finetune=False, no_load_optim=False, in_samples=False, scaler=loss_scale.initial()
    )
    assert plan.progress == Progress(40, 320, 16, 38)
    assert plan.scaler == loss_scale.LossScale(scale=1024.0, clean_steps=7)
    assert not plan.fresh_optimizer and "layout unchanged" in plan.description


def test_a_fresh_optimizer_keeps_iteration_and_samples_but_restarts_schedules_and_scaler():
    scaler = loss_scale.initial()
    plan = resume(META, finetune=False, no_load_optim=True, in_samples=False, scaler=scaler)
    assert plan.progress == Progress(40, 320, 16, 0) and plan.scaler == scaler
    assert plan.fresh_optimizer
    assert "fresh optimizer state and schedules" in plan.description


def test_resume_weights_only_starts_the_run_afresh():
    plan = resume(META, finetune=True, no_load_optim=False, in_samples=True, scaler=None)
    assert (
        plan.progress == Progress() and plan.fresh_optimizer and "weights only" in plan.description
    )


def test_resume_at_another_layout_says_so_and_an_old_checkpoint_counts_its_schedule():
    # written before fmeg recorded it
    old = {k: v for k, v in META.items() if k != "scheduler_steps"}
    for in_samples, scheduled in ((True, 320), (False, 40)):
        plan = resume(
            old,
            finetune=False,
            no_load_optim=False,
            in_samples=in_samples,
            scaler=None,
            layout_note="resharded from tp 2 x pp 1 (x1 virtual) x dp 1",
        )
        assert plan.progress.scheduled == scheduled and "resharded from" in plan.description


def test_the_saved_layout_reads_as_the_start_line_words_not_a_dict():
    import torch

    from fmeg.parallel.layout import Layout, describe_saved

    meta = Layout(tp=2, pp=2, chunks=2, dp=2, sharding="optim").checkpoint_meta(torch.bfloat16)
    assert describe_saved(meta) == (
        "tp 2 x pp 2 (x2 virtual) x dp 2, distributed optimizer, bfloat16"
    )
    apart = Layout(dp=2, ep=2, etp=1, cp=2, stage_layers=(1, 3), sharding="optim_grads")
    assert describe_saved(apart.checkpoint_meta(torch.float32)) == (
        "tp 1 x pp 1 (x1 virtual) x dp 2 x cp 2 (experts: ep 2, tp 1), layers per stage 1|3, "
        "sharded optim_grads, float32"
    )
    # an older checkpoint's few keys, a newer one's unknown key, none at all
    assert describe_saved({"tp": 2}) == "tp 2 x pp 1 (x1 virtual) x dp 1"
    assert describe_saved({"tp": 1, "dtype": "float32", "new": 3}).endswith(", new 3, float32")
    assert "{" not in describe_saved(None)


def test_a_static_loss_scale_is_the_flags_whatever_the_checkpoint_saved():
    plan = resume(
        META,
        finetune=False,
        no_load_optim=False,
        in_samples=False,
        scaler=loss_scale.static(8192.0),
    )
    assert plan.scaler == loss_scale.static(8192.0)


def test_exit_policy():
    kw = dict(
        exit_interval=None, exit_duration_in_mins=None, minutes_since_start=0.0, signalled=False
    )
    assert exit_reasons(6, **kw) == []
    assert exit_reasons(6, **{**kw, "exit_interval": 3}) == ["--exit-interval 3"]
    assert exit_reasons(7, **{**kw, "exit_interval": 3}) == []
    assert exit_reasons(1, **{**kw, "exit_duration_in_mins": 2.0, "minutes_since_start": 2.5}) == [
        "--exit-duration-in-mins 2.0"
    ]
    assert exit_reasons(1, **{**kw, "exit_duration_in_mins": 2.0, "minutes_since_start": 1.0}) == []
    assert exit_reasons(1, **{**kw, "signalled": True}) == ["SIGTERM received"]


def test_save_and_evaluate_policy():
    assert should_save(5, save="ck", save_interval=5, train_iters=20, exiting=False)
    assert not should_save(6, save="ck", save_interval=5, train_iters=20, exiting=False)
    assert should_save(6, save="ck", save_interval=5, train_iters=20, exiting=True)
    assert should_save(20, save="ck", save_interval=None, train_iters=20, exiting=False)
    assert not should_save(20, save=None, save_interval=5, train_iters=20, exiting=True)
    assert should_evaluate(10, eval_interval=5, train_iters=12) and should_evaluate(
        12, eval_interval=5, train_iters=12
    )
    assert not should_evaluate(11, eval_interval=5, train_iters=12)
    assert not should_evaluate(12, eval_interval=None, train_iters=12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.booleans()), max_size=30), st.booleans())
def test_the_schedules_count_successful_updates_in_samples_or_iterations(steps, in_samples):
    p = Progress()
    for batch, skipped in steps:
        p = p.after_step(global_batch=batch, skipped=skipped, in_samples=in_samples)
    done = [b for b, skipped in steps if not skipped]
    assert p.iteration == len(steps) and p.consumed == sum(b for b, _ in steps)
    assert p.scheduled == (sum(done) if in_samples else len(done))
    # no scaler: skipped steps are NaN iterations
    assert p.nans == len(steps) - len(done) and p.skipped == 0


def test_fp16_skip_accounting_follows_the_scaler():
    # with a scaler an overflow is a skipped step, without one a NaN iteration
    p = Progress()
    for overflow in (True, True, False, False, True):
        p = p.after_step(global_batch=4, skipped=overflow, in_samples=False, scaled=True)
    assert (p.skipped, p.nans, p.scheduled) == (3, 0, 2)
    p = Progress().after_step(global_batch=4, skipped=True, in_samples=False)
    assert (p.skipped, p.nans, p.scheduled) == (0, 1, 0)


def test_the_nan_policy_is_megatrons_check():
    dynamic, floor = loss_scale.initial(2.0**16), loss_scale.initial(1.0, min_scale=1.0)
    assert (
        non_finite_stop(skipped=True, loss_non_finite=True, scaler=dynamic, check_for_nan=True)
        == "non-finite loss"
    )
    assert (
        non_finite_stop(skipped=True, loss_non_finite=False, scaler=dynamic, check_for_nan=True)
        is None
    )
    assert "minimum loss scale" in non_finite_stop(
        skipped=True, loss_non_finite=False, scaler=floor, check_for_nan=True
    )
    assert (
        non_finite_stop(
            skipped=True, loss_non_finite=False, scaler=loss_scale.static(8.0), check_for_nan=True
        )
        is None
    )
    assert (
        non_finite_stop(skipped=True, loss_non_finite=False, scaler=None, check_for_nan=True)
        == "non-finite gradient"
    )
    assert (
        non_finite_stop(skipped=True, loss_non_finite=True, scaler=None, check_for_nan=False)
        is None
    )
    assert config([]).training.check_for_nan
    assert not config(["--no-check-for-nan-in-loss-and-grad"]).training.check_for_nan


def test_loss_scale_is_a_static_scale_not_a_prefix_of_loss_scale_window():
    cfg = config(["--fp16", "--loss-scale", "8192"])
    assert cfg.precision.scaler == loss_scale.static(8192.0)
    assert loss_scale.update(cfg.precision.scaler, True) == cfg.precision.scaler
    # dynamic from 2**32, window 1000
    assert config(["--fp16"]).precision.scaler == loss_scale.initial()
    assert config(["--bf16", "--loss-scale", "4"]).precision.scaler == loss_scale.static(4.0)
    a = parse_args(["--loss-scale", "8"])
    assert a.notices[-1].startswith("--loss-scale 8 has no effect without --fp16 or --bf16")


@pytest.mark.parametrize("schedule", ["0:4 640:8", "0:8,1K:16 2.5K:24", "0:2 0.5K:4 1k:8"])
def test_step_batch_size_schedule_is_megatrons(schedule):
    steps = parse_step_schedule(schedule, 16)
    for consumed in range(0, 400, 2):
        assert global_batch_size(consumed, steps[-1][1], None, steps) == megatron_step_batch(
            schedule, 16, consumed
        )
    total = iterations_for(400, steps[-1][1], None, steps)
    consumed = 0
    for _ in range(total):
        consumed += global_batch_size(consumed, steps[-1][1], None, steps)
    assert consumed <= 400 < consumed + steps[-1][1]


@pytest.mark.parametrize(
    "schedule, needle",
    [
        ("64:4 640:8", "the first threshold must be 0"),
        ("0:4 banana", "'banana' is not THRESHOLD:BATCH_SIZE"),
        ("0:4 0:8", "two thresholds fall on the same sample"),
        ("0:3 640:8", "batch sizes [3] must be multiples"),
    ],
)
def test_a_bad_step_schedule_is_one_line(schedule, needle):
    a = parse_args(
        ["--step-batch-size-schedule", schedule, "--micro-batch-size", "2", "--seq-length", "16"]
    )
    problems = validate(a, 1)
    assert len(problems) == 1 and needle in problems[0], problems


def test_null_tokenizer_has_vocab_size_ids_with_the_last_the_end_of_document():
    tok = NullTokenizer(10)
    assert (tok.vocab_size, tok.eod) == (10, 9) and tok.encode("3 7") == [3, 7]
    cfg = config(
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--mock-data"], vocab=10
    )
    assert cfg.model.vocab_size == 10


def test_lr_warmup_samples_zero_is_megatrons_default_with_iterations():
    a = parse_args(["--lr-warmup-samples", "0", "--train-iters", "10"])
    assert (
        validate(a, 1) == []
        and not config(["--lr-warmup-samples", "0"]).training.schedules_in_samples
    )


@pytest.mark.parametrize(
    "flag",
    [
        "--lr",
        "--min-lr",
        "--clip-grad",
        "--adam-eps",
        "--init-method-std",
        "--hidden-dropout",
        "--loss-scale",
        "--exit-duration-in-mins",
    ],
)
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_float_flags_are_refused(flag, value):
    problems = validate(parse_args([f"{flag}={value}"]), 1)
    assert f"{flag} must be a finite number, got {float(value)}" in problems


def test_rampup_batch_size_warns_that_current_megatron_ignores_it():
    a = parse_args(["--rampup-batch-size", "4", "4", "40", "--global-batch-size", "8"])
    assert any(
        "--rampup-batch-size is deprecated and ignored by current Megatron" in n for n in a.notices
    )
