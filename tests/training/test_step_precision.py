"""Under --bf16 the runner's iteration does its matrix work in bf16: at least 99% of one iteration's
matmul FLOPs (forward, backward, the fused output-projection + loss included), counted op by op
under a TorchDispatchMode with torch's own FLOP formulas."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params, train_iteration
from fmeg.training.step_settings import StepSettings


class MatmulFlopsByDtype(TorchDispatchMode):
    """FLOPs of every op torch's flop counter knows (mm, addmm, bmm, attention, ...), by input
    dtype."""

    def __init__(self):
        super().__init__()
        self.flops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.flops[dtype] += count(*args, **kwargs, out_val=out)
        return out


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_a_bf16_iteration_does_its_matmuls_in_bf16(style):
    config = getattr(gpt.GPTConfig, style)(
        vocab_size=4096,
        max_seq_len=64,
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2 if style == "llama" else None,
    )
    mesh, layout = Mesh.single(), Layout()
    state = init_state(
        shard_params(gpt.init(config, 0), config, layout, mesh),
        config,
        layout,
        mesh,
        compute_dtype=torch.bfloat16,
    )
    tokens = torch.randint(
        0, config.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0)
    )
    microbatch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(4, 64)}
    with MatmulFlopsByDtype() as counted:
        train_iteration(
            state,
            [microbatch],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(lr=1e-3, weight_decay=0.0, clip_grad=1.0),
        )
    total = sum(counted.flops.values())
    assert total > 6 * 4 * 64 * 4096 * 64  # the output layer's forward and backward at least
    assert counted.flops[torch.bfloat16] >= 0.99 * total, dict(counted.flops)
