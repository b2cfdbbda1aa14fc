"""Context parallelism: each comm type (ring p2p, all_gather, a2a) gives this rank's rows of one
device's causal attention and of its gradients of q, k and v, with grouped-query attention, RoPE'd
inputs and keyed attention dropout, at cp 2 and 4, on ranks that are threads and on gloo processes;
and vmap over a batch of queries (without dropout)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import spmd_programs as P
from fmeg import ops
from fmeg.models import gpt
from fmeg.ops import attention_blocks as blocks
from fmeg.parallel import context
from harness.parallel import run
from harness.runner import assert_refused_in_one_line
from harness.context import assert_cp_ranks_sum_to_one_device, assert_each_rank_holds_its_rows

f64 = torch.float64


def one_device(q, k, v, dropout):
    if dropout == 0:
        return ops.causal_attention(q, k, v)
    return ops.causal_attention(q, k, v, dropout_p=dropout, key=7, total_heads=q.shape[1])


def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert context.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert context.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([context.positions(16, 4, r) for r in range(4)]).tolist()) == list(
        range(16)
    )
    with pytest.raises(ValueError, match="divisible by 2 x context-parallel size = 4"):
        context.positions(6, 2, 0)


@pytest.mark.parametrize(
    "backend, world", [("threads", 2), ("threads", 4), ("gloo", 2), ("gloo", 4)]
)
@pytest.mark.parametrize("comm_type", context.COMM_TYPES)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_context_parallel_attention_equals_one_device(backend, world, comm_type, data):
    """a2a+p2p draws its a2a level's size a (a x p = cp, p the ring's): heads divide by a."""
    a = (
        data.draw(st.sampled_from([s for s in (1, 2, 4) if world % s == 0]), label="a2a level")
        if comm_type == "a2a+p2p"
        else 1
    )
    split = {"a2a": world, "a2a+p2p": a}.get(comm_type)  # what heads are split by
    groups = data.draw(
        st.sampled_from([1, 2, 4] if split is None else [split, 2 * split]), label="kv heads"
    )
    heads = groups * data.draw(st.sampled_from([1, 2]), label="heads per group")
    d = data.draw(st.sampled_from([4, 8]), label="head dim")
    c = data.draw(st.integers(1, 3), label="chunk")
    dropout = data.draw(st.sampled_from([0.0, 0.3]), label="attention dropout")
    rope = data.draw(st.booleans(), label="rope")
    seq, b = 2 * world * c, 2
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    q, dout = (
        torch.randn(b, heads, seq, d, generator=gen, dtype=f64),
        torch.randn(b, heads, seq, d, generator=gen, dtype=f64),
    )
    k, v = (torch.randn(b, groups, seq, d, generator=gen, dtype=f64) for _ in range(2))
    if rope:  # the inputs as the model gives them: rotated by their global positions
        cos, sin = ops.rope_cos_sin(torch.arange(seq), d, 10000.0)
        q, k = (
            ops.apply_rope(q, cos.to(f64), sin.to(f64)),
            ops.apply_rope(k, cos.to(f64), sin.to(f64)),
        )
    want, vjp = torch.func.vjp(lambda q, k, v: one_device(q, k, v, dropout), q, k, v)
    want_grads = vjp(dout)
    results = run(
        backend,
        world,
        P.context_attention,
        q,
        k,
        v,
        dout,
        comm_type,
        dropout,
        tp=1,
        cp=world,
        cp_a2a=a,
    )
    assert_each_rank_holds_its_rows(
        results, want, want_grads, lambda: one_device(2 * q, k, v, 0) if dropout == 0 else None
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_blocks_call_the_memory_efficient_kernel_as_its_schema_and_shapes_say(dtype):
    """What CI can check of the CUDA blocks without a GPU (tests/test_cuda.py checks their numbers):
    on meta tensors the memory-efficient kernel's forward and backward take the arguments the blocks
    pass, and give back what the blocks expect: the lse cut to the block's 40 rows (the kernel pads
    it to 64) and fp32, the gradients in the inputs' shapes and dtype."""
    q, k, v = (torch.empty(2, 4, 40, 8, device="meta", dtype=dtype) for _ in range(3))
    out, lse = blocks.cuda_forward(q, k, v, causal=True)
    assert (
        out.shape == q.shape
        and out.dtype == dtype
        and lse.shape == (2, 4, 40)
        and lse.dtype == torch.float32
    )
    grads = blocks.cuda_backward(out, q, k, v, out, lse, causal=False)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype)] * 3
    assert blocks.kernel(torch.zeros(1), None) == "cpu" and blocks.kernel(q, None) is None


def small(style, **overrides):
    base = dict(
        vocab_size=40,
        max_seq_len=16,
        num_layers=2,
        hidden_size=16,
        num_heads=4,
        ffn_hidden_size=24,
        hidden_dropout=0.2,
        attention_dropout=0.2,
    )
    # experts (every layer), with the balance losses split over cp as over sp
    if style in ("moe", "moe_seq"):
        moe = dict(
            num_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=8,
            moe_aux_loss_coeff=0.1,
            moe_z_loss_coeff=0.01,
            moe_shared_expert_intermediate_size=8,
            moe_router_load_balancing_type="aux_loss" if style == "moe" else "seq_aux_loss",
        )
        return gpt.GPTConfig.llama(**{**base, "num_kv_heads": 2, **moe, **overrides})
    if style == "llama":
        return gpt.GPTConfig.llama(**{**base, "num_kv_heads": 2, **overrides})
    return gpt.GPTConfig.gpt2(**{**base, **overrides})


@pytest.mark.parametrize(
    "style, comm_type, world, tp",
    [
        ("llama", "p2p", 2, 1),
        ("gpt2", "all_gather", 2, 1),
        ("llama", "a2a", 2, 1),
        ("llama", "p2p", 4, 1),
        ("llama", "a2a+p2p", 4, 1),
        ("gpt2", ("a2a+p2p", "p2p"), 8, 2),
        ("llama", "p2p", 4, 2),
        ("gpt2", "a2a", 4, 2),
        ("llama", ("a2a", "all_gather"), 2, 1),
        ("moe", "p2p", 2, 1),
        ("moe_seq", "p2p", 4, 2),
        ("moe", "all_gather", 4, 1),
    ],
)
def test_the_gpt_under_context_parallelism_equals_one_device(style, comm_type, world, tp):
    """Loss and every gradient with dropout on (hidden and attention masks keyed by global
    positions), RoPE or learned positions, a loss mask: the cp ranks' losses and gradients sum to
    one device's, tp 2 + sp inside."""
    config = small(style)
    params = gpt.init(config, 0, dtype=f64)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=gen)
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": (torch.rand(2, 16, generator=gen) > 0.3).to(f64),
    }
    want_grads, want_loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config, key=5))(
        params
    )
    cp = world // tp
    results = run(
        "threads",
        world,
        P.context_parallel_gpt,
        params,
        batch,
        config,
        5,
        comm_type,
        tp=tp,
        cp=cp,
        sequence_parallel=tp > 1,
        cp_a2a=2 if "a2a+p2p" in comm_type else 1,
    )
    assert_cp_ranks_sum_to_one_device(results, want_loss, want_grads, tp)


@pytest.mark.parametrize(
    "comm_type, world, tp",
    [
        ("p2p", 2, 1),
        ("a2a", 2, 1),  # 10 s each, 25 s at 4 ranks
        pytest.param("all_gather", 2, 1, marks=pytest.mark.slow),
        pytest.param("a2a+p2p", 4, 1, marks=pytest.mark.slow),
        pytest.param("p2p", 4, 2, marks=pytest.mark.slow),
    ],
)
def test_the_gpt_under_context_parallelism_compiles_as_one_graph_with_one_devices_numbers(
    comm_type, world, tp
):
    """torch.compile(fullgraph=True) of the loss under cp (aot_eager: dynamo and AOTAutograd, no
    code generation): one graph, no graph break, and the cp ranks' losses and gradients sum to one
    device's. p2p and all_gather enter the graph as one opaque op each way, a2a as its all-to-alls
    and one device's attention."""
    config = small("llama")
    params = gpt.init(config, 0, dtype=f64)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=gen)
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(2, 16, dtype=f64),
    }
    want_grads, want_loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config, key=5))(
        params
    )
    results = run(
        "gloo",
        world,
        P.compiled_context_parallel_gpt,
        params,
        batch,
        config,
        5,
        comm_type,
        "aot_eager",
        tp=tp,
        cp=world // tp,
        sequence_parallel=tp > 1,
        cp_a2a=2 if comm_type == "a2a+p2p" else 1,
    )
    assert all(graphs == 1 and breaks == {} for *_, graphs, breaks in results)
    assert_cp_ranks_sum_to_one_device(results, want_loss, want_grads, tp)


CP_BAD = [
    (
        {"WORLD_SIZE": "2"},
        ["--context-parallel-size", "2", "--seq-length", "18"],
        "--seq-length 18 must be divisible by 2 x --context-parallel-size = 4",
    ),
    (
        {"WORLD_SIZE": "4"},
        [
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            "a2a",
            "--num-attention-heads",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "--cp-comm-type a2a splits heads over --context-parallel-size 2",
    ),
    (
        {"WORLD_SIZE": "2"},
        [
            "--context-parallel-size",
            "2",
            "--cp-comm-type",
            "p2p",
            "a2a",
            "p2p",
            "p2p",
            "--num-attention-heads",
            "3",
            "--hidden-size",
            "48",
        ],
        "--cp-comm-type a2a splits heads",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"],
        "--cp-comm-type: 2 values for --num-layers 4",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P",
    ),
    (
        {"WORLD_SIZE": "4"},
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "3",
        ],
        "--hierarchical-context-parallel-sizes 2 3: give two positive sizes",
    ),
    (
        {"WORLD_SIZE": "4"},
        ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "4"],
        "whose product is --context-parallel-size 4",
    ),
    (
        {"WORLD_SIZE": "4"},
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--num-attention-heads",
            "2",
            "--hierarchical-context-parallel-sizes",
            "4",
            "1",
        ],
        "--cp-comm-type a2a+p2p splits heads over its a2a level",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--context-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size", "4"],
        "--expert-model-parallel-size 4 x expert tensor parallelism 1 must divide tp x dp x cp = "
        "1 x 1 x 2",
    ),
    ({"WORLD_SIZE": "3"}, ["--context-parallel-size", "2"], "world size 3 must be divisible by"),
    (
        {"WORLD_SIZE": "1"},
        ["--context-parallel-size", "0"],
        "--context-parallel-size must be positive",
    ),
]


@pytest.mark.parametrize("env, flags, needle", CP_BAD, ids=[b[2][:40] for b in CP_BAD])
def test_bad_context_parallel_arguments_fail_before_any_work_with_one_line(
    monkeypatch, capsys, env, flags, needle
):
    assert_refused_in_one_line(monkeypatch, capsys, env, flags, needle)
