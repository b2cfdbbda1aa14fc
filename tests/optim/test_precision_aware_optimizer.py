"""Megatron's precision-aware optimizer (--use-precision-aware-optimizer with --exp-avg-dtype and
--exp-avg-sq-dtype bf16, as the DeepSeek-V3 script runs it): Adam's moments are stored in bf16 and
stepped in fp32, which is AdamW whose moments are rounded to bf16 after every step; the state
shrinks by 4 bytes per parameter, and a checkpoint keeps the bf16 moments and resumes on its
curve."""

import pytest
import torch

from fmeg import optim, tree
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.optim import adam as fused
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params, train_iteration
from fmeg.training.step_settings import StepSettings
from harness.runner import run_layout

CONFIG = gpt.GPTConfig.llama(
    vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2
)


def batches(steps):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        t = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=gen)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:]})
    return out


def reference(steps, lr=1e-2, weight_decay=0.1):
    """fmeg.optim.adamw in fp32 with its moments rounded to bf16 after each step."""
    params = gpt.init(CONFIG, 0)
    opt = optim.adamw(b1=0.9, b2=0.999, eps=1e-8)
    state = opt.init(params)
    for batch in batches(steps):
        grads = torch.func.grad(gpt.loss)(params, batch, CONFIG)
        updates, state = opt.update(grads, state, params, lr=lr, weight_decay=weight_decay)
        params = optim.apply_updates(params, updates)
        narrow = lambda t: tree.tree_map(lambda x: x.bfloat16().float(), t)  # noqa: E731
        state = (state[0]._replace(mu=narrow(state[0].mu), nu=narrow(state[0].nu)), *state[1:])
    return params, state[0]


def trained(moment_dtype, steps=5):
    mesh, layout = Mesh.single(), Layout()
    state = init_state(
        shard_params(gpt.init(CONFIG, 0), CONFIG, layout, mesh),
        CONFIG,
        layout,
        mesh,
        moment_dtypes=(moment_dtype, moment_dtype),
    )
    for batch in batches(steps):
        train_iteration(
            state,
            [batch],
            config=CONFIG,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(lr=1e-2, weight_decay=0.1, clip_grad=0.0),
        )
    return state


def off_by_more_than(tol, got: dict, want: dict) -> float:
    """The fraction of all elements where got and want differ by more than tol."""
    off = sum(int(((got[p] - want[p]).abs() > tol).sum()) for p in want)
    return off / sum(t.numel() for t in want.values())


@pytest.mark.parametrize("chunk", [fused.NARROW_CHUNK, 100])
def test_bf16_moments_are_adamw_with_moments_rounded_after_each_step(chunk, monkeypatch):
    """Five steps: the weights agree with the reference to 1e-6 but where a moment landed on the
    other side of a bf16 rounding boundary (one ulp, moving that weight's later updates by under
    1e-4; a few in a hundred), while fp32 moments move nearly every weight away from it; the stored
    moments are the reference's, in bf16."""
    monkeypatch.setattr(fused, "NARROW_CHUNK", chunk)  # also through chunks that cut leaves apart
    want, adam = reference(5)
    expected, moments = tree.flatten(want), tree.flatten(adam.mu)
    state = trained(torch.bfloat16)
    got, got_moments = tree.flatten(state.params[0]), tree.flatten(state.opt_state["adam"].mu[0])
    assert got.keys() == expected.keys()
    assert off_by_more_than(1e-6, got, expected) < 0.02
    assert all((got[p] - expected[p]).abs().max() < 1e-4 for p in got)
    assert off_by_more_than(1e-6, tree.flatten(trained(torch.float32).params[0]), expected) > 0.5
    assert all(t.dtype == torch.bfloat16 for t in got_moments.values())
    assert (
        off_by_more_than(
            1e-3 * max(m.abs().max() for m in moments.values()),
            {p: t.float() for p, t in got_moments.items()},
            moments,
        )
        < 0.02
    )


def test_bf16_moments_save_four_bytes_per_parameter():
    mesh, layout = Mesh.single(), Layout()
    params = shard_params(gpt.init(CONFIG, 0), CONFIG, layout, mesh)
    plain = init_state(params, CONFIG, layout, mesh, compute_dtype=torch.bfloat16)
    narrow = init_state(
        params,
        CONFIG,
        layout,
        mesh,
        compute_dtype=torch.bfloat16,
        moment_dtypes=(torch.bfloat16, torch.bfloat16),
    )
    assert (plain.bytes_per_parameter(), narrow.bytes_per_parameter()) == (18.0, 14.0)


def test_the_runner_trains_saves_and_resumes_bf16_moments_on_their_curve(tmp_path):
    flags = [
        "--bf16",
        "--use-distributed-optimizer",
        "--use-precision-aware-optimizer",
        "--main-grads-dtype",
        "fp32",
        "--main-params-dtype",
        "fp32",
        "--exp-avg-dtype",
        "bf16",
        "--exp-avg-sq-dtype",
        "bf16",
    ]
    whole = run_layout(tmp_path, "whole", 2, flags)
    ckpt = tmp_path / "ckpt"
    run_layout(
        tmp_path,
        "first",
        2,
        [*flags, "--save", str(ckpt), "--train-iters", "10", "--lr-decay-iters", "20"],
    )
    resumed = run_layout(tmp_path, "second", 2, [*flags, "--load", str(ckpt)])
    assert resumed == whole[10:]
