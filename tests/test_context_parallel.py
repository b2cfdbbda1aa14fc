"""Context parallelism: each comm type (ring p2p, all_gather, a2a) gives this rank's rows of one device's causal
attention and of its gradients of q, k and v, with grouped-query attention, RoPE'd inputs and keyed attention
dropout, at cp 2 and 4, on ranks that are threads and on gloo processes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spmd_programs as P
from fmeg import ops
from fmeg.parallel import context
from parallel_harness import run

f64 = torch.float64


def one_device(q, k, v, dropout):
    if dropout == 0:
        return ops.causal_attention(q, k, v)
    return ops.causal_attention(q, k, v, dropout_p=dropout, key=7, total_heads=q.shape[1])


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert context.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([context.positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="divisible by 2 x context-parallel size = 4"):
        context.positions(6, 2, 0)


@pytest.mark.parametrize("backend, world", [("threads", 2), ("threads", 4), ("gloo", 2), ("gloo", 4)])
@pytest.mark.parametrize("comm_type", context.COMM_TYPES)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_context_parallel_attention_equals_one_device(backend, world, comm_type, data):
    groups = data.draw(st.sampled_from([1, 2, 4] if comm_type != "a2a" else [world, 2 * world]), label="kv heads")
    heads = groups * data.draw(st.sampled_from([1, 2]), label="heads per group")
    d = data.draw(st.sampled_from([4, 8]), label="head dim")
    c = data.draw(st.integers(1, 3), label="chunk")
    dropout = data.draw(st.sampled_from([0.0, 0.3]), label="attention dropout")
    rope = data.draw(st.booleans(), label="rope")
    seq, b = 2 * world * c, 2
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    q, dout = torch.randn(b, heads, seq, d, generator=gen, dtype=f64), torch.randn(b, heads, seq, d, generator=gen,
                                                                                    dtype=f64)
    k, v = (torch.randn(b, groups, seq, d, generator=gen, dtype=f64) for _ in range(2))
    if rope:  # the inputs as the model gives them: rotated by their global positions
        cos, sin = ops.rope_cos_sin(torch.arange(seq), d, 10000.0)
        q, k = ops.apply_rope(q, cos.to(f64), sin.to(f64)), ops.apply_rope(k, cos.to(f64), sin.to(f64))
    want, vjp = torch.func.vjp(lambda q, k, v: one_device(q, k, v, dropout), q, k, v)
    want_grads = vjp(dout)
    results = run(backend, world, P.context_attention, q, k, v, dout, comm_type, dropout, tp=1, cp=world)
    for r, got in enumerate(results):
        mine = lambda t: context.shard_sequence(t, context.ContextParallel(None), dim=2).index_select(  # noqa: E731
            2, context.positions(seq, world, r))
        torch.testing.assert_close(got["out"], mine(want), rtol=1e-10, atol=1e-10)
        for g, w in zip(got["grads"], want_grads):
            torch.testing.assert_close(g, mine(w), rtol=1e-10, atol=1e-10)
