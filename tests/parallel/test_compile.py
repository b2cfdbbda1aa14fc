"""Compilation in the runner's step: each pipeline stage runs torch.compile'd as one graph, or,
where the data-parallel overlap needs each layer's gradients as they finish (or whole layers are
recomputed), every layer, the embedding and the loss head apart (fullgraph: a graph break is an
error), collectives inside the graphs, with the numbers of the eager step. Runner-level layout tests
with --compile are in test_gpt_pretrain.py."""

import pytest
import torch

from harness import spmd_programs as P
from fmeg.models import gpt
from fmeg.parallel.spmd import GlooRanks

GPT2 = gpt.GPTConfig.gpt2(
    num_layers=4,
    hidden_size=32,
    num_heads=4,
    vocab_size=96,
    max_seq_len=16,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
LLAMA = gpt.GPTConfig.llama(
    num_layers=4,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=96,
    max_seq_len=16,
    ffn_hidden_size=64,
)


def microbatches(config, count=2, batch=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        out.append(
            {
                "tokens": tokens,
                "labels": torch.roll(tokens, -1, 1),
                "loss_mask": torch.ones(batch, seq),
                "dropout_key": torch.tensor(1000 + i),
            }
        )
    return out


def run(world, config, layout_kwargs, compile, sp=False, iterations=3, overlap=False, **sizes):
    # fresh processes: dynamo's counters are per process
    with GlooRanks(world, timeout=300) as ranks:
        return ranks.run(
            P.compiled_training,
            config,
            layout_kwargs,
            microbatches(config),
            iterations,
            compile,
            torch.float32,
            overlap,
            sequence_parallel=sp,
            **sizes,
        )


def check_same_numbers(compiled, eager):
    """Per rank and iteration: the losses (None off the last pipeline stage) and gradient norms
    agree to 1e-6 at the first iteration (the same weights: only the compiler's rounding differs)
    and to 1e-4 after it, where Adam has turned rounding-level gradient differences into steps of
    about lr on some elements."""
    for (c_losses, c_norms, *_), (e_losses, e_norms, *_) in zip(compiled, eager):
        for i, (c_loss, c_norm, e_loss, e_norm) in enumerate(
            zip(c_losses, c_norms, e_losses, e_norms)
        ):
            rel = 1e-6 if i == 0 else 1e-4
            assert c_norm == pytest.approx(e_norm, rel=rel)
            assert (c_loss is None) == (e_loss is None)
            assert c_loss is None or c_loss == pytest.approx(e_loss, rel=rel)
    assert any(loss is not None for losses, *_ in compiled for loss in losses)


# 40 s; compiled layers stay in the default suite (test_training, the data-parallel overlap below)
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_tp2_sequence_parallel_stage_is_one_graph_with_the_eager_numbers(backend):
    """tp=2 with sequence parallelism and dropout: the stage (embedding, four layers, loss head) is
    one graph, with no graph break (fullgraph), nothing recompiles after the first iteration, and
    the losses and gradient norms are the eager step's. aot_eager captures the same graphs as
    inductor (dynamo and AOTAutograd) without generating code, which takes minutes on 2 CPU
    cores."""
    compiled = run(2, GPT2, {}, backend, sp=True, tp=2)
    eager = run(2, GPT2, {}, None, sp=True, tp=2)
    check_same_numbers(compiled, eager)
    for _, _, graphs, breaks in compiled:
        assert breaks == {}
        assert graphs[0] == graphs[-1] == 1
    assert all(graphs == [0, 0, 0] for _, _, graphs, _ in eager)


@pytest.mark.slow  # compiled layers stay in tests/training/test_training.py
def test_under_data_parallel_overlap_each_layer_is_compiled_and_the_layers_share_a_graph():
    """dp=2 with --overlap-grad-reduce: the layers' gradients go to their buckets as each layer's
    backward ends, so each layer is a compiled segment of its own; the four share one graph (the
    layer index turns symbolic at the second layer), with the eager numbers."""
    compiled = run(2, GPT2, {}, "aot_eager", overlap=True)  # two ranks, tp = pp = 1: dp = 2
    eager = run(2, GPT2, {}, None, overlap=True)
    check_same_numbers(compiled, eager)
    for _, _, graphs, breaks in compiled:
        assert breaks == {}
        assert graphs[0] == graphs[-1] <= 4  # embedding, layer (index 0, then symbolic), head


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout_kwargs",
    [{}, {"recompute": ("selective", None, None)}, {"recompute": ("full", "uniform", 2)}],
    ids=["plain", "selective", "full"],
)
def test_compiled_llama_under_tp2_pp2_with_recomputation_has_the_eager_numbers(layout_kwargs):
    compiled = run(4, LLAMA, layout_kwargs, "inductor", sp=True, tp=2, pp=2)
    eager = run(4, LLAMA, layout_kwargs, None, sp=True, tp=2, pp=2)
    check_same_numbers(compiled, eager)
    assert all(breaks == {} for *_, breaks in compiled)
