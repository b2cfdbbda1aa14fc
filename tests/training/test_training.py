"""The one training step (parallel_step.train_iteration) on a single rank: it learns, clips, keys
dropout, and gives the same numbers eagerly and with its layers compiled. Its layouts are in
test_gpt_pretrain.py."""

import numpy as np
import pytest
import torch

from fmeg import optim, tree
from fmeg.data.token_file import random_windows
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params, train_iteration
from fmeg.training.step_settings import StepSettings

MESH, LAYOUT = Mesh.single(), Layout()


def setup(style="gpt2", **kw):
    base = dict(vocab_size=32, max_seq_len=16, num_layers=2, hidden_size=64, num_heads=4)
    if style == "llama":
        base["num_kv_heads"] = 2
    config = getattr(gpt.GPTConfig, style)(**{**base, **kw})
    params = shard_params(gpt.init(config, 0), config, LAYOUT, MESH)
    return config, init_state(params, config, LAYOUT, MESH)


def step(state, config, batch, lr=1e-3, weight_decay=0.0, clip_grad=1.0, compile=None):
    return train_iteration(
        state,
        [batch],
        config=config,
        layout=LAYOUT,
        mesh=MESH,
        settings=StepSettings(
            lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, compile=compile
        ),
    )


def test_a_small_model_learns_a_repeated_pattern_to_near_zero_loss():
    config, state = setup("llama")
    pattern = np.random.default_rng(0).permutation(config.vocab_size)[:20]
    stream = np.tile(pattern, 200)
    schedule = optim.LRSchedule(
        max_lr=3e-3, min_lr=3e-4, warmup_steps=10, decay_steps=200, style="cosine"
    )
    losses = [
        float(
            step(state, config, random_windows(stream, 8, 16, seed=0, step=i), schedule(i), 0.01)[
                "loss"
            ]
        )
        for i in range(200)
    ]
    assert losses[0] > 3.0
    assert max(losses[-10:]) < 0.05, losses[-10:]


def test_grad_norm_is_reported_before_clipping_and_the_update_is_clipped():
    config, state = setup()
    full = gpt.init(config, 0)
    batch = random_windows(np.arange(1000) % 32, 4, 16, seed=0, step=0)
    grads = torch.func.grad(gpt.loss)(full, batch, config)
    metrics = step(state, config, batch, lr=1.0, clip_grad=1e-3)
    torch.testing.assert_close(metrics["grad_norm"].float(), tree.global_norm(grads))
    # the first Adam step sets mu = (1 - beta1) * the clipped gradient
    coef = 1e-3 / float(metrics["grad_norm"])
    mu = state.opt_state["adam"].mu[0]["layers"][0]["mlp"]["fc2"]["weight"]
    torch.testing.assert_close(
        mu, (1 - 0.9) * coef * grads["layers"][0]["mlp"]["fc2"]["weight"], rtol=1e-4, atol=1e-10
    )


def test_the_same_state_and_batch_give_the_same_step_and_the_dropout_key_changes_it():
    config, _ = setup(hidden_dropout=0.1)
    batch = random_windows(np.arange(1000) % 32, 4, 16, seed=0, step=0)
    losses = []
    for key in (1, 1, 2):
        _, state = setup(hidden_dropout=0.1)
        losses.append(step(state, config, {**batch, "dropout_key": torch.tensor(key)})["loss"])
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_layers_give_the_eager_step(backend):
    config, eager = setup(hidden_dropout=0.1)
    _, compiled = setup(hidden_dropout=0.1)
    stream = np.arange(5000) % 29
    for i in range(3):
        batch = {**random_windows(stream, 4, 16, seed=1, step=i), "dropout_key": torch.tensor(i)}
        m_e = step(eager, config, batch, lr=1e-3 * (i + 1), weight_decay=0.01)
        m_c = step(compiled, config, batch, lr=1e-3 * (i + 1), weight_decay=0.01, compile=backend)
        torch.testing.assert_close(m_c["loss"], m_e["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m_c["grad_norm"], m_e["grad_norm"], rtol=1e-5, atol=1e-6)
    # Adam divides by sqrt(v): an element whose gradient is at rounding level moves by about +-lr
    # whichever way the rounding fell, so parameters are compared to a small fraction of one step.
    for (path, a), b in zip(tree.items(compiled.params), tree.tree_leaves(eager.params)):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5, msg=path)


def test_step_settings_given_whole_or_as_keywords_make_the_same_step():
    batch = {"tokens": torch.arange(16).view(1, 16) % 32, "labels": torch.arange(1, 17).view(1, 16)}
    where = dict(layout=LAYOUT, mesh=MESH)
    config, whole = setup()
    _, keywords = setup()
    settings = StepSettings(lr=1e-2, weight_decay=0.1, clip_grad=0.5)
    for _ in range(2):
        a = train_iteration(whole, [batch], config=config, settings=settings, **where)
        b = train_iteration(keywords, [batch], config=config, lr=1e-2, weight_decay=0.1,
                            clip_grad=0.5, **where)  # fmt: skip
        assert float(a["loss"]) == float(b["loss"])
    with pytest.raises(TypeError, match="not both"):
        train_iteration(whole, [batch], config=config, settings=settings, lr=1.0, **where)
