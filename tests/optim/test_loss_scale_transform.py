"""with_loss_scale, the dynamic loss scaler as a gradient transformation wrapping an optimizer,
gives the runner's steps: on one rank in fp32, a loss scale too large for fp32 overflows, the step
is skipped and the scale falls, then clean steps train and the scale grows again, and the pytree
form and train_iteration agree on every loss, skip, scale and weight."""

import numpy as np
import torch

from fmeg import optim, tree
from fmeg.data.token_file import random_windows
from fmeg.models import gpt
from fmeg.optim import loss_scale
from fmeg.parallel.layout import Layout
from fmeg.parallel.mesh import Mesh
from fmeg.training.parallel_step import init_state, shard_params, train_iteration
from fmeg.training.step_settings import StepSettings

# no biases: a key bias's gradient is zero up to rounding, which Adam would magnify to +-lr
CONFIG = gpt.GPTConfig.llama(
    vocab_size=32, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2
)
HYPER = dict(lr=1e-2, weight_decay=0.1)


def test_the_pytree_loss_scaler_skips_and_steps_as_the_runner_does():
    batches = [random_windows(np.arange(1000) % 32, 4, 16, seed=0, step=k) for k in range(9)]
    # 2**127 times the loss's gradients overflows fp32 until it has fallen; a window of 2 grows it
    scaler = loss_scale.initial(2.0**127, min_scale=1.0, window=2, hysteresis=1)
    params = gpt.init(CONFIG, 0)
    tx = loss_scale.with_loss_scale(
        optim.chain(optim.clip_by_global_norm(1.0), optim.adamw()), scaler
    )
    opt_state = tx.init(params)
    mesh, layout = Mesh.single(), Layout()
    # the runner's state steps the same transform's flat form, its scaler the state's
    state = init_state(
        shard_params(params, CONFIG, layout, mesh), CONFIG, layout, mesh, scaler=scaler
    )
    skips = []
    for batch in batches:
        scale = opt_state.scaler.scale
        assert state.scaler == opt_state.scaler
        grads, loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, CONFIG) * scale)(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params, **HYPER)
        params = optim.apply_updates(params, updates)
        settings = StepSettings(**HYPER, clip_grad=1.0)
        m = train_iteration(state, [batch], config=CONFIG, layout=layout, mesh=mesh,
                            settings=settings)  # fmt: skip
        assert m["loss_scale"] == scale
        skips.append(bool(m["skipped"]))
        assert opt_state.scaler == state.scaler
    # skipped while too large, then stepping, with the growth after each clean window overflowing
    first_step = skips.index(False)
    assert skips[0] and any(skips[first_step:]), skips
    assert int(opt_state.inner[1][0].count) == skips.count(False)
    runner = tree.flatten(state.params[0])
    # the two forms sum the gradients in different orders: where an element's gradient is near
    # zero Adam magnifies the last-bit difference (seen: one element of 4096 off by 1.9e-6 on an
    # AVX-512 CPU), far below the lr-sized steps a wrong skip or scale would make
    for name, value in tree.flatten(params).items():
        torch.testing.assert_close(runner[name], value, rtol=1e-5, atol=1e-5, msg=name)
