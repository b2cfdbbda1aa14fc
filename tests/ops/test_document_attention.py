"""Packed documents (Megatron's --reset-attention-mask): each document attends to itself only.
Attention by cu_seqlens equals each document run alone (outputs and gradients; vjp, jvp, vmap;
compiled as one opaque op), and a packed batch's logits, loss and gradients equal its documents run
one by one through the GPT, with positions restarting per document, at one rank, tp 2 + sp, cp 2
(each comm type) and pp 2."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness import spmd_programs as P
from fmeg import ops, tree
from fmeg.data.gpt_dataset import documents_of
from fmeg.models import gpt
from fmeg.ops.document_attention import document_spans
from fmeg.parallel.sharding import shard
from harness.parallel import run
from harness.context import assert_cp_ranks_sum_to_one_device, assert_each_rank_holds_its_rows

f64 = torch.float64


def packing(lengths_per_row):
    """cu_seqlens [b, s + 1] of rows of documents with these lengths (each row's lengths sum to
    s)."""
    s = sum(lengths_per_row[0])
    rows = []
    for lengths in lengths_per_row:
        ends = torch.tensor(lengths).cumsum(0).tolist()
        rows.append([0, *ends] + [s] * (s + 1 - 1 - len(ends)))
    return torch.tensor(rows)


@st.composite
def packed_rows(draw, seq=None):
    s = seq or draw(st.integers(1, 24), label="seq")
    b = draw(st.integers(1, 3), label="rows")
    rows = []
    for _ in range(b):
        cuts = (
            sorted(draw(st.sets(st.integers(1, s - 1), max_size=5), label="boundaries"))
            if s > 1
            else []
        )
        rows.append([e - a for a, e in zip([0, *cuts], [*cuts, s])])
    return rows


def each_alone(q, k, v, spans):
    """The reference: every document through one device's causal attention on its own."""
    return torch.cat(
        [
            torch.cat(
                [
                    ops.causal_attention(
                        q[r : r + 1, :, a:e], k[r : r + 1, :, a:e], v[r : r + 1, :, a:e]
                    )
                    for a, e in row
                ],
                dim=2,
            )
            for r, row in enumerate(spans)
        ],
        dim=0,
    )


@settings(max_examples=25, deadline=None)
@given(
    lengths=packed_rows(),
    groups=st.sampled_from([1, 2]),
    per_group=st.sampled_from([1, 2]),
    seed=st.integers(0, 10**6),
)
def test_document_attention_equals_each_document_alone(lengths, groups, per_group, seed):
    cu = packing(lengths)
    b, s = len(lengths), cu.shape[1] - 1
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, groups * per_group, s, 8, generator=gen, dtype=f64) for _ in range(2))
    k, v = (torch.randn(b, groups, s, 8, generator=gen, dtype=f64) for _ in range(2))
    spans = document_spans(cu, s)
    want, want_vjp = torch.func.vjp(lambda q, k, v: each_alone(q, k, v, spans), q, k, v)
    got, vjp = torch.func.vjp(lambda q, k, v: ops.document_attention(q, k, v, cu), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(vjp(dout), want_vjp(dout)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    compiled = torch.compile(
        lambda q, k, v, cu: ops.document_attention(q, k, v, cu), backend="aot_eager", fullgraph=True
    )
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    out = compiled(qc, kc, vc, cu)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(torch.autograd.grad(out, (qc, kc, vc), dout), want_vjp(dout)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_jvp_and_vmap_follow_each_document():
    cu = packing([[3, 5, 4], [12]])
    gen = torch.Generator().manual_seed(0)
    q, k, v, tangent = (torch.randn(2, 2, 12, 4, generator=gen, dtype=f64) for _ in range(4))
    spans = document_spans(cu, 12)
    with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel has no forward-mode AD
        got = torch.func.jvp(lambda q: ops.document_attention(q, k, v, cu), (q,), (tangent,))
        want = torch.func.jvp(lambda q: each_alone(q, k, v, spans), (q,), (tangent,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    batched = torch.func.vmap(lambda q: ops.document_attention(q, k, v, cu))(
        torch.stack([q, 2 * q])
    )
    torch.testing.assert_close(batched[1], each_alone(2 * q, k, v, spans), rtol=1e-10, atol=1e-10)


def test_attention_dropout_is_keyed_by_global_position_eager_compiled_and_head_sharded():
    """The compiled op drops the same probabilities as the eager ops, and two head shards (tensor
    parallelism, by head_offset) drop those of the whole."""
    cu = packing([[5, 7], [2, 3, 7]])
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 4, 12, 8, generator=gen, dtype=f64, requires_grad=True) for _ in range(3)
    )
    key = torch.tensor(11)
    eager = ops.document_attention(q, k, v, cu, dropout_p=0.3, key=key)
    compiled = torch.compile(
        lambda q, k, v, cu: ops.document_attention(q, k, v, cu, dropout_p=0.3, key=key),
        backend="aot_eager",
        fullgraph=True,
    )(q, k, v, cu)
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)
    for g, w in zip(
        torch.autograd.grad(compiled.sum(), (q, k, v)), torch.autograd.grad(eager.sum(), (q, k, v))
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    halves = [
        ops.document_attention(
            q[:, h : h + 2],
            k[:, h : h + 2],
            v[:, h : h + 2],
            cu,
            dropout_p=0.3,
            key=key,
            head_offset=h,
            total_heads=4,
        )
        for h in (0, 2)
    ]
    torch.testing.assert_close(torch.cat(halves, dim=1), eager, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(eager, ops.document_attention(q, k, v, cu))  # something was dropped


@pytest.mark.parametrize("backend, world", [("threads", 2), ("threads", 4), ("gloo", 2)])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a", "a2a+p2p"])
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_context_parallel_document_attention_equals_one_device(backend, world, comm_type, data):
    """Each comm type over packed documents gives this rank's rows of one device's document
    attention and of its gradients, with grouped-query attention and keyed dropout; vmap without
    dropout."""
    a = 2 if comm_type == "a2a+p2p" and world == 4 else 1
    split = {"a2a": world, "a2a+p2p": a}.get(comm_type, 1)
    groups = split * data.draw(st.sampled_from([1, 2]), label="kv heads per split")
    heads = groups * data.draw(st.sampled_from([1, 2]), label="heads per group")
    seq = 2 * world * data.draw(st.integers(1, 3), label="chunk")
    lengths = data.draw(packed_rows(seq), label="documents")
    dropout = data.draw(st.sampled_from([0.0, 0.3]), label="attention dropout")
    cu, b = packing(lengths), len(lengths)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    q, dout = (torch.randn(b, heads, seq, 4, generator=gen, dtype=f64) for _ in range(2))
    k, v = (torch.randn(b, groups, seq, 4, generator=gen, dtype=f64) for _ in range(2))
    drop = {} if dropout == 0 else dict(dropout_p=dropout, key=7, total_heads=heads)
    want, vjp = torch.func.vjp(lambda q, k, v: ops.document_attention(q, k, v, cu, **drop), q, k, v)
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
        cu,
        tp=1,
        cp=world,
        cp_a2a=a,
    )
    assert_each_rank_holds_its_rows(
        results,
        want,
        want_grads,
        lambda: ops.document_attention(2 * q, k, v, cu) if dropout == 0 else None,
    )


def test_boundaries_that_do_not_cover_the_sequence_are_refused():
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="rise from 0 to the sequence length 4"):
        ops.document_attention(q, q, q, torch.tensor([[0, 3, 2, 4, 4]]))
    with pytest.raises(ValueError, match="rise from 0 to the sequence length 4"):
        ops.document_attention(q, q, q, torch.tensor([[0, 3, 3, 3, 3]]))


# ------------------------------------------------------------------------------------------------
# the GPT over packed documents


def small(style):
    base = dict(
        vocab_size=40, max_seq_len=16, num_layers=2, hidden_size=16, num_heads=4, ffn_hidden_size=24
    )
    if style == "llama":
        return gpt.GPTConfig.llama(**base, num_kv_heads=2)
    return gpt.GPTConfig.gpt2(**base)


EOD = 39


def packed_batch(seed, b=2, s=16):
    """Rows of documents ending with EOD, as GPTDataset packs them: tokens, labels, positions reset
    per document, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, EOD, (b, s + 1), generator=gen)
    text[torch.rand(b, s + 1, generator=gen) < 0.2] = EOD
    rows = [
        documents_of(t[:-1], EOD, reset_position_ids=True, reset_attention_mask=True) for t in text
    ]
    return {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": torch.ones(b, s, dtype=f64),
        "position_ids": torch.stack([r["position_ids"] for r in rows]),
        "cu_seqlens": torch.stack([r["cu_seqlens"] for r in rows]),
    }


def documents_one_by_one(params, batch, config):
    """(logits, sum of token losses) of every document run alone (positions from 0), in the batch's
    places."""
    spans = document_spans(batch["cu_seqlens"], batch["tokens"].shape[1])
    logits, total = [], 0.0
    for r, row in enumerate(spans):
        parts = []
        for a, e in row:
            doc = {k: batch[k][r : r + 1, a:e] for k in ("tokens", "labels", "loss_mask")}
            parts.append(gpt.apply(params, doc["tokens"], config))
            total = total + gpt.loss(params, doc, config) * (e - a)
        logits.append(torch.cat(parts, dim=1))
    return torch.cat(logits), total


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_a_packed_batch_equals_its_documents_one_by_one_on_one_rank(style):
    config = small(style)
    params = gpt.init(config, 0, dtype=f64)
    batch = packed_batch(1)
    assert (batch["cu_seqlens"][:, 1:-1] < 16).any()  # some row holds several documents
    want_logits, _ = documents_one_by_one(params, batch, config)
    got = gpt.apply(
        params,
        batch["tokens"],
        config,
        positions=batch["position_ids"],
        documents=batch["cu_seqlens"],
    )
    torch.testing.assert_close(got, want_logits, rtol=1e-10, atol=1e-10)
    n = batch["tokens"].numel()
    want = torch.func.grad(lambda p: documents_one_by_one(p, batch, config)[1] / n)(params)
    got = torch.func.grad(lambda p: gpt.loss(p, batch, config))(params)
    for path, g in tree.flatten(got).items():
        torch.testing.assert_close(g, tree.flatten(want)[path], rtol=1e-9, atol=1e-11, msg=path)


@pytest.mark.parametrize(
    "layout", ["tp2_sp", "cp2_p2p", "cp2_all_gather", "cp2_a2a", "cp2_tp2", "pp2"]
)
def test_a_packed_batch_is_layout_invariant_with_dropout(layout):
    """The loss and gradients of a packed batch (dropout on) at tp 2 + sp, cp 2 (p2p, all_gather,
    a2a), cp 2 (a2a) x tp 2 + sp and pp 2 equal one device's."""

    # a2a splits heads over tp x cp
    config = small("llama").replace(
        hidden_dropout=0.2, attention_dropout=0.2, num_kv_heads=4 if layout == "cp2_tp2" else 2
    )
    params = gpt.init(config, 0, dtype=f64)
    batch = packed_batch(2)
    want_grads, want_loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config, key=5))(
        params
    )
    if layout == "tp2_sp":
        results = run(
            "threads",
            2,
            P.gpt_loss_and_grads,
            params,
            batch,
            config,
            5,
            tp=2,
            sequence_parallel=True,
        )
        for t, (loss, grads) in enumerate(results):
            torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12)
            want = tree.flatten(shard(want_grads, gpt.TP_RULES, {"tp": (t, 2)}))
            for path, g in tree.flatten(grads).items():
                torch.testing.assert_close(g, want[path], rtol=1e-9, atol=1e-11, msg=path)
    elif layout.startswith("cp2"):
        tp = 2 if layout == "cp2_tp2" else 1
        comm_type = layout.removeprefix("cp2_") if tp == 1 else "a2a"
        results = run(
            "threads",
            2 * tp,
            P.context_parallel_gpt,
            params,
            batch,
            config,
            5,
            comm_type,
            tp=tp,
            cp=2,
            sequence_parallel=tp > 1,
        )
        assert_cp_ranks_sum_to_one_device(results, want_loss, want_grads, tp)
    else:
        from fmeg.models import gpt_pipeline as gp

        halves = [{k: t[i : i + 1] for k, t in batch.items()} for i in range(2)]
        for mb in halves:
            mb["dropout_key"] = 5
        want_loss, want_grads = gp.reference_loss_and_grads(params, halves, config)
        results = run("threads", 2, P.pipelined_gpt, params, halves, config, "1f1b", 1, tp=1, pp=2)
        merged = gp.merge({s: g for _, grads in results for s, g in grads.items()}, config)
        torch.testing.assert_close(
            [loss for loss, _ in results if loss is not None][0], want_loss, rtol=1e-10, atol=1e-12
        )
        want = tree.flatten(want_grads)
        for path, g in tree.flatten(merged).items():
            torch.testing.assert_close(g, want[path], rtol=1e-9, atol=1e-11, msg=path)
