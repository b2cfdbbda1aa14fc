"""Zero-bubble's split backward: B computes the input gradient and every gradient but the linears'
weights, W the linears' weight gradients (the experts' grouped GEMMs and the FP8 linears too);
together they are the unsplit backward's numbers, and on torch's FLOP counter B and W split the
backward's matmuls, W taking exactly the weight-gradient products (2 x rows x in x out per
linear)."""

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


# gated experts on every layer: the grouped GEMMs' weights are deferred too
CONFIGS["llama_experts"] = CONFIGS["llama_gated"].replace(num_experts=4, moe_router_topk=2)


def fp8_parallel(config, recipe):
    """The model's transforms on one rank, with FP8 linears under recipe (None: none)."""
    if recipe is None:
        return gp.NO_TP
    from fmeg.fp8.delayed import DelayedState
    from fmeg.fp8.plan import Fp8Plan
    from fmeg.fp8.recipe import Fp8Recipe
    from fmeg.parallel.layout import Layout
    from fmeg.parallel.mesh import Mesh
    from fmeg.training.stage_functions import model_parallel

    state = DelayedState(config.num_layers, 4) if recipe == "delayed" else None
    plan = Fp8Plan(Fp8Recipe("hybrid", recipe), config.num_layers, state=state)
    return model_parallel(Layout(), Mesh.single(), plan)


def batch(config):
    t = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 8)}


def grouped_mm_flops(a, b, offs=None, *rest, out_val=None, **kwargs):
    """torch's counter has no formula for _grouped_mm: 2 x the rows the experts hold x in x out
    (a [rows, in] by b [E, in, out]; or the weight gradient, a [out, rows] by b [rows, in])."""
    offs = kwargs["offs"] if offs is None else offs
    rows = int(offs[-1])
    return 2 * rows * (a.shape[1] * b.shape[2] if b.dim() == 3 else a.shape[0] * b.shape[1])


grouped_mm_flops._get_raw = True


def counted(fn):
    mapping = {torch.ops.aten._grouped_mm: grouped_mm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        out = fn()
    return out, counter.get_total_flops()


@pytest.mark.parametrize(
    "style, recipe",
    [(style, None) for style in sorted(CONFIGS)]
    + [("llama_gated", "tensorwise"), ("llama_gated", "blockwise"), ("gpt2", "delayed")],
)
def test_b_and_w_are_the_backward_split_in_two(style, recipe):
    config = CONFIGS[style]
    params = gp.split(gpt.init(config, 0), config, 1)[0]
    segments = gp.stage_segments(config, 0, 1, fp8_parallel(config, recipe))
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
    # an expert's weight sees the rows routed to it: topk rows per token over the E experts
    experts = config.experts
    rows = {
        p: tokens * experts.router.topk / experts.num_experts if ".experts." in p else tokens
        for p in linears
    }
    assert w_flops == sum(2 * rows[p] * leaves[p].numel() for p in linears)
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
