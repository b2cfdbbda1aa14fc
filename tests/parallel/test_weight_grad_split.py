"""Zero-bubble's split backward: B computes the input gradient and every gradient but the linears'
weights, W the linears' weight gradients; together they are the unsplit backward's numbers, and on
torch's FLOP counter B and W split the backward's matmuls, W taking exactly the weight-gradient
products (2 x tokens x in x out per linear)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fmeg import tree
from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.ops import weight_grads
from fmeg.parallel.pipeline.execute import _backward, _forward, weight_gradients

CONFIGS = {
    "gpt2": gpt.GPTConfig.gpt2(
        vocab_size=48, max_seq_len=8, num_layers=2, hidden_size=16, num_heads=2
    ),
    "llama_gated": gpt.GPTConfig.llama(
        vocab_size=48,
        max_seq_len=8,
        num_layers=2,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=24,
    ),
}


def batch(config):
    t = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 8)}


def counted(fn):
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


@pytest.mark.parametrize("style", sorted(CONFIGS))
def test_b_and_w_are_the_backward_split_in_two(style):
    config = CONFIGS[style]
    params = gp.split(gpt.init(config, 0), config, 1)[0]
    segments = gp.stage_segments(config, 0, 1)
    mb = batch(config)
    seed = torch.ones(())

    _, entries = _forward(segments, params, None, mb)
    (_, whole), whole_flops = counted(lambda: _backward(entries, seed, params, mb))

    _, entries = _forward(segments, params, None, mb, split=True)
    deferred: list = []
    _, b_flops = counted(lambda: _backward(entries, seed, params, mb, deferred=deferred))
    split, w_flops = counted(lambda: weight_gradients(deferred))

    for got, want in zip(split, whole):
        assert got.keys() == want.keys()
        for path in want:
            torch.testing.assert_close(got[path], want[path], rtol=0, atol=0, msg=path)
    assert b_flops + w_flops == whole_flops
    # every linear of the layers and the output layer: their weights' products went to W
    deferred_paths = {path for _, pending, _ in deferred for path, _ in pending}
    leaves = dict(tree.items(params))
    linears = {
        p for p in leaves if p.endswith("weight") and leaves[p].dim() >= 2 and "embedding" not in p
    }
    assert deferred_paths == linears, deferred_paths ^ linears
    tokens = 2 * 8
    assert w_flops == sum(2 * tokens * leaves[p].numel() for p in linears)
    assert 0.3 < w_flops / whole_flops < 0.7


def test_defer_keeps_only_the_named_leaves():
    x = torch.randn(3, 4, requires_grad=True)
    w, v = torch.randn(5, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    with weight_grads.deferrable():
        y = weight_grads.DeferrableLinear.apply(x, w, None) + weight_grads.DeferrableLinear.apply(
            x, v, None
        )
    pending: list = []
    with weight_grads.deferring({id(w): "w"}, pending):
        dx, dw, dv = torch.autograd.grad(y.sum(), (x, w, v), allow_unused=True)
    assert dw is None and dv is not None and [p for p, _ in pending] == ["w"]
    torch.testing.assert_close(pending[0][1](), torch.ones(3, 5).t() @ x)
