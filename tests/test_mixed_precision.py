"""Mixed precision: Megatron's dynamic loss scaler; an overflowed fp16 step changes nothing and halves the
scale; bf16 trains along the fp32 curve."""

import json

import torch

from fmeg import tree
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.training import loss_scale
from fmeg.training.parallel_step import Layout, init_state, shard_params, train_iteration
from runner_harness import run_layout

CONFIG = gpt.GPTConfig.gpt2(vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4)


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


def step(dtype, scale):
    """(the state's tensors before, after, metrics) of one step, which updates the state in place."""
    mesh, layout = Mesh.single(), Layout()
    params = shard_params(gpt.init(CONFIG, 0), CONFIG, layout, mesh)
    state = init_state(params, CONFIG, layout, mesh, distributed=False, compute_dtype=dtype)
    t = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = [{"tokens": t[:, :-1], "labels": t[:, 1:]}]
    before = [x.clone() for x in tree.tree_leaves((state.params, state.opt_state))]
    m = train_iteration(state, batch, config=CONFIG, layout=layout, mesh=mesh, lr=1e-2, weight_decay=0.0,
                        clip_grad=1.0, loss_scale=scale, check_overflow=True)
    assert state.opt_state["main"][0]["layers"][0]["attn"]["qkv"]["weight"].dtype == torch.float32
    return before, tree.tree_leaves((state.params, state.opt_state)), m


def test_an_overflowed_fp16_step_is_skipped_and_changes_nothing():
    before, after, m = step(torch.float16, 2.0**40)
    assert m["skipped"] and all(torch.equal(a, b) for a, b in zip(before, after))
    before, after, m = step(torch.float16, 2.0**10)
    assert not m["skipped"] and not torch.equal(after[0], before[0])


def test_injected_overflow_through_the_runner_skips_and_halves(tmp_path):
    run_layout(tmp_path, "fp16", 1, ["--fp16", "--initial-loss-scale", str(2.0**20), "--hysteresis", "1"])
    records = [json.loads(line) for line in (tmp_path / "fp16" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["skipped"] and records[1]["loss_scale"] == records[0]["loss_scale"] / 2
    assert not all(r["skipped"] for r in records)  # the scale comes down until steps go through


def test_bf16_trains_along_the_fp32_curve(tmp_path, reference):
    got = run_layout(tmp_path, "bf16", 1, ["--bf16"])
    assert all(abs(a - b) <= 0.01 * b for a, b in zip(got, reference["plain"]))
    assert got[-1] < got[0] - 1.0
