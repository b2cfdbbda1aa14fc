"""The training step learns, is pure, and gives the same numbers eagerly and under torch.compile."""

from functools import partial

import numpy as np
import torch

from fmeg import optim, tree
from fmeg.data.token_file import random_windows
from fmeg.models import gpt
from fmeg.train_step import compile_train_step, make_train_step


def setup(style="gpt2", clip=1.0, **kw):
    base = dict(vocab_size=32, max_seq_len=16, num_layers=2, hidden_size=64, num_heads=4)
    if style == "llama":
        base["num_kv_heads"] = 2
    config = getattr(gpt.GPTConfig, style)(**{**base, **kw})
    params = gpt.init(config, 0)
    opt = optim.adamw()
    step = make_train_step(partial(gpt.loss, config=config), opt, clip_grad=clip)
    return config, params, opt.init(params), step


def test_a_small_model_learns_a_repeated_pattern_to_near_zero_loss():
    config, params, state, step = setup("llama")
    pattern = np.random.default_rng(0).permutation(config.vocab_size)[:20]
    stream = np.tile(pattern, 200)
    schedule = optim.LRSchedule(max_lr=3e-3, min_lr=3e-4, warmup_steps=10, decay_steps=200, style="cosine")
    losses = []
    for i in range(200):
        batch = random_windows(stream, 8, 16, seed=0, step=i)
        params, state, m = step(params, state, batch, torch.tensor(schedule(i)), torch.tensor(0.01))
        losses.append(m["loss"].item())
    assert losses[0] > 3.0
    assert max(losses[-10:]) < 0.05, losses[-10:]


def test_step_is_pure():
    config, params, state, step = setup()
    batch = random_windows(np.arange(1000) % 32, 4, 16, seed=0, step=0)
    before = tree.tree_map(torch.clone, params)
    out1 = step(params, state, batch, torch.tensor(1e-3), torch.tensor(0.1))
    out2 = step(params, state, batch, torch.tensor(1e-3), torch.tensor(0.1))
    assert all(torch.equal(a, b) for a, b in zip(tree.tree_leaves(params), tree.tree_leaves(before)))
    assert all(torch.equal(a, b) for a, b in zip(tree.tree_leaves(out1), tree.tree_leaves(out2)))


def test_grad_norm_is_reported_before_clipping_and_the_update_is_clipped():
    config, params, state, step = setup(clip=1e-3)
    batch = random_windows(np.arange(1000) % 32, 4, 16, seed=0, step=0)
    grads = torch.func.grad(gpt.loss)(params, batch, config)
    _, _, metrics = step(params, state, batch, torch.tensor(1e-3), torch.tensor(0.0))
    torch.testing.assert_close(metrics["grad_norm"], tree.global_norm(grads))
    assert metrics["grad_norm"] > 1e-3


def test_dropout_key_changes_the_step():
    config, params, state, step = setup(hidden_dropout=0.1)
    batch = random_windows(np.arange(1000) % 32, 4, 16, seed=0, step=0)
    lr, wd = torch.tensor(1e-3), torch.tensor(0.0)
    l1 = step(params, state, batch, lr, wd, torch.tensor(1))[2]["loss"]
    l1b = step(params, state, batch, lr, wd, torch.tensor(1))[2]["loss"]
    l2 = step(params, state, batch, lr, wd, torch.tensor(2))[2]["loss"]
    assert torch.equal(l1, l1b) and not torch.equal(l1, l2)


def test_compiled_step_equals_eager_step():
    config, params, state, step = setup(hidden_dropout=0.1)
    compiled = compile_train_step(step)
    stream = np.arange(5000) % 29
    p_e, s_e, p_c, s_c = params, state, params, state
    for i in range(3):
        batch = random_windows(stream, 4, 16, seed=1, step=i)
        args = (batch, torch.tensor(1e-3 * (i + 1)), torch.tensor(0.01), torch.tensor(i))
        p_e, s_e, m_e = step(p_e, s_e, *args)
        p_c, s_c, m_c = compiled(p_c, s_c, *args)
        torch.testing.assert_close(m_c["loss"], m_e["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m_c["grad_norm"], m_e["grad_norm"], rtol=1e-5, atol=1e-6)
    # Adam divides by sqrt(v): an element whose gradient is at rounding level moves by about +-lr
    # whichever way the rounding fell, so parameters are compared to a small fraction of one step.
    for (path, a), b in zip(tree.items(p_c), tree.tree_leaves(p_e)):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5, msg=path)
