"""Mixed precision: Megatron's dynamic loss scaler; an overflowed fp16 step changes nothing and
halves the scale; bf16 trains along the fp32 curve."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg import tree
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.optim import loss_scale
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params, train_iteration
from fmeg.training.step_settings import StepSettings
from harness.runner import run_layout, run_recipe
from harness.steps import megatron_scaler

CONFIG = gpt.GPTConfig.gpt2(
    vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4
)


def test_scaler_halves_after_hysteresis_overflows_and_doubles_after_a_clean_window():
    s = loss_scale.initial(1024.0, min_scale=1.0, window=3, hysteresis=2)
    trace = []
    for overflow in [True, True, True, False, False, False, True]:
        s = loss_scale.update(s, overflow)
        trace.append(s.scale)
    assert trace == [1024.0, 512.0, 256.0, 256.0, 256.0, 512.0, 512.0]
    tiny = loss_scale.initial(2.0, min_scale=1.0, hysteresis=1)
    for _ in range(3):
        tiny = loss_scale.update(tiny, True)
    assert tiny.scale == 1.0


@settings(max_examples=60, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=60),
    initial=st.sampled_from([2.0**32, 2.0**16, 4.0]),
    min_scale=st.sampled_from([1.0, 2.0**10]),
    window=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
)
def test_scaler_equals_megatron_cores_step_by_step(
    overflows, initial, min_scale, window, hysteresis
):
    min_scale = min(min_scale, initial)  # as the runner's flags require
    with pytest.MonkeyPatch.context() as monkeypatch:
        oracle = megatron_scaler(monkeypatch, initial, min_scale, window, hysteresis)
        s = loss_scale.initial(initial, min_scale=min_scale, window=window, hysteresis=hysteresis)
        for overflow in overflows:
            s = loss_scale.update(s, overflow)
            oracle.update(overflow)
            assert s.scale == float(oracle.scale)


def step(dtype, scale):
    """(the state's tensors before, after, metrics) of one step, which updates the state in
    place."""
    mesh, layout = Mesh.single(), Layout()
    params = shard_params(gpt.init(CONFIG, 0), CONFIG, layout, mesh)
    state = init_state(
        params, CONFIG, layout, mesh, compute_dtype=dtype, scaler=loss_scale.static(scale)
    )
    t = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = [{"tokens": t[:, :-1], "labels": t[:, 1:]}]
    before = [x.clone() for x in tree.tree_leaves((state.params, state.opt_state))]
    m = train_iteration(
        state,
        batch,
        config=CONFIG,
        layout=layout,
        mesh=mesh,
        settings=StepSettings(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
    )
    assert state.opt_state["main"][0]["layers"][0]["attn"]["qkv"]["weight"].dtype == torch.float32
    return before, tree.tree_leaves((state.params, state.opt_state)), m


def test_an_overflowed_fp16_step_is_skipped_and_changes_nothing():
    before, after, m = step(torch.float16, 2.0**40)
    assert m["skipped"] and all(torch.equal(a, b) for a, b in zip(before, after))
    before, after, m = step(torch.float16, 2.0**10)
    assert not m["skipped"] and not torch.equal(after[0], before[0])


def test_injected_overflow_through_the_runner_skips_and_halves_and_the_schedule_waits(
    tmp_path, monkeypatch
):
    """Overflowed fp16 steps are skipped, the scale halves, and the LR and weight-decay schedules
    advance only after successful updates: step by step what megatron-core's OptimizerParamScheduler
    gives when stepped as Megatron's training loop steps it (by the global batch, after each
    successful update), and the loss scale is megatron-core's DynamicGradScaler's, updated after
    every step."""
    from types import SimpleNamespace

    OptimizerParamScheduler = pytest.importorskip(
        "megatron.core.optimizer_param_scheduler"
    ).OptimizerParamScheduler

    run_layout(
        tmp_path,
        "fp16",
        1,
        [
            "--fp16",
            "--initial-loss-scale",
            str(2.0**20),
            "--hysteresis",
            "1",
            "--start-weight-decay",
            "0.0",
            "--end-weight-decay",
            "0.1",
            "--weight-decay-incr-style",
            "linear",
        ],
    )
    records = [
        json.loads(line) for line in (tmp_path / "fp16" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[0]["skipped"] and records[1]["loss_scale"] == records[0]["loss_scale"] / 2
    assert not all(r["skipped"] for r in records)  # the scale comes down until steps go through
    assert sum(r["skipped"] for r in records) >= 2
    group = {"params": [], "lr": 0.0, "weight_decay": 0.0}
    # harness.runner.COMMON: 20 iterations of 8 samples, warmup 2 iterations, Megatron's default
    # decay
    gbs = 8
    scheduler = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[group]),
        init_lr=0.0,
        max_lr=3e-3,
        min_lr=0.0,
        lr_warmup_steps=2 * gbs,
        lr_decay_steps=20 * gbs,
        lr_decay_style="linear",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=20 * gbs,
        wd_incr_style="linear",
    )
    scaler = megatron_scaler(monkeypatch, 2.0**20, 1.0, 1000, 1)
    for r in records:
        assert r["loss_scale"] == float(scaler.scale)
        scaler.update(r["skipped"])
        assert r["lr"] == pytest.approx(group["lr"], rel=1e-12, abs=1e-15)
        assert r["weight_decay"] == pytest.approx(group["weight_decay"], rel=1e-12, abs=1e-15)
        if not r["skipped"]:
            scheduler.step(increment=gbs)


def test_bf16_trains_along_the_fp32_curve(tmp_path, reference):
    got = run_layout(tmp_path, "bf16", 1, ["--bf16"])
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(got, reference["plain"]))
    assert got[-1] < got[0] - 1.0


@pytest.mark.slow  # fp16 reduction stays in the default suite
def test_grad_reduce_in_bf16_reduces_in_bf16_and_trains_along_the_fp32_curve(tmp_path, reference):
    """Megatron's --grad-reduce-in-bf16 with --bf16: gradients are accumulated over microbatches and
    reduced over data parallelism in bf16 (so the curve moves off the fp32-reduced one), and the
    step reads an fp32 copy; the run still follows the fp32 curve."""
    records, stdout = run_recipe(tmp_path, "bf16_grads", 2, ["--bf16", "--grad-reduce-in-bf16"])
    assert "bfloat16 (gradients reduced in bfloat16)" in stdout
    fp32_reduced = run_layout(tmp_path, "bf16", 2, ["--bf16"])
    got = [r["lm_loss"] for r in records if "lm_loss" in r]
    assert got != fp32_reduced
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(got, reference["plain"]))


def test_fp16_reduces_gradients_in_fp16_unless_asked_for_fp32_as_megatron(tmp_path, reference):
    """Megatron's --fp16 accumulates and reduces gradients in fp16 (unscaled and checked for
    overflow in an fp32 copy); --accumulate-allreduce-grads-in-fp32 keeps them in fp32. Both follow
    the fp32 curve."""
    fp16 = ["--fp16", "--initial-loss-scale", "4096"]
    half, stdout = run_recipe(tmp_path, "fp16_grads", 1, fp16)
    assert "float16 (gradients reduced in float16)" in stdout
    full, stdout = run_recipe(
        tmp_path, "fp32_grads", 1, [*fp16, "--accumulate-allreduce-grads-in-fp32"]
    )
    assert "gradients reduced in" not in stdout
    half, full = ([r["lm_loss"] for r in records if "lm_loss" in r] for records in (half, full))
    assert half != full
    for curve in (half, full):
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(curve, reference["plain"]))
