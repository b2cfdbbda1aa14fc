"""Fully sharded data parallelism on the wire, counted with the recording communicator at dp 2
over one iteration of a 4-layer GPT with tied embeddings (two microbatches per rank): each unit
(the word embeddings, the position embeddings, a layer, the final norm, the tied output copy) is
padded to a multiple of dp and split evenly, so a unit costs one all-gather per use and one
reduce-scatter per reduction, of the unit's padded bytes (each rank sends (dp - 1) / dp of them),
for every strategy of Megatron-FSDP; nothing else but the gradient norm's all-reduce. The tied
copies are units of one size: their chunks are summed on the rank (pp 1), no whole copy is
reduced."""

from collections import Counter

import pytest
import torch

from harness import spmd_programs as P
from fmeg.models import gpt
from fmeg.parallel.spmd import run_threads

CONFIG = gpt.GPTConfig.gpt2(
    vocab_size=96, max_seq_len=16, num_layers=4, hidden_size=32, num_heads=4
)
DP, PER_RANK = 2, 2


def microbatches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(DP * PER_RANK):
        t = torch.randint(0, 96, (2, 17), generator=g)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 16)})
    return out


def formula(sharding: str, units: dict[str, int], bytes_: int, policy: str) -> Counter:
    """{(collective, bytes): count} for one iteration."""
    want: Counter = Counter()
    for numel in units.values():
        size = numel * bytes_
        # ZeRO-1's gradient buffer is whole: reduced once per iteration; else each microbatch's
        want[("reduce_scatter", size)] += 1 if sharding == "optim" else PER_RANK
        if sharding == "optim_grads_params":
            # gathered for the forward and again for the backward, unless kept between
            want[("all_gather", size)] += PER_RANK * (1 if policy == "false" else 2)
        else:
            # the updated chunks gathered back
            want[("all_gather", size)] += 1
    # the gradient norm (fp64)
    want[("all_reduce", 8)] += 1
    return want


@pytest.mark.parametrize(
    "sharding, policy",
    [
        ("optim", "true"),
        ("optim_grads", "true"),
        ("optim_grads_params", "true"),
        ("optim_grads_params", "false"),
    ],
)
def test_each_unit_costs_one_all_gather_per_use_and_one_reduce_scatter_per_reduction(
    sharding, policy
):
    results = run_threads(DP, P.fsdp_on_the_wire, CONFIG, sharding, microbatches(), 2, policy, tp=1)
    for log, units, bytes_ in results:
        assert all(numel % DP == 0 for numel in units.values())
        assert set(units) == {f"0.layers.{i}" for i in range(4)} | {
            "0.embedding.word",
            "0.embedding",
            "0.final_norm",
            "0.output",
        }
        assert units["0.embedding.word"] == units["0.output"]
        assert Counter(log) == formula(sharding, units, bytes_, policy), sharding
        # no broadcast, no reduce to one rank
        assert {op for op, _ in log} <= {"all_gather", "reduce_scatter", "all_reduce"}


def test_what_each_rank_sends_is_its_share_of_the_units():
    """optim_grads_params: the volume is the padded units' bytes (of which a ring sends (dp - 1) /
    dp from each rank): per iteration, 2 uses x 2 microbatches of the whole padded model gathered
    and 2 reductions of it scattered."""
    log, units, bytes_ = run_threads(
        DP, P.fsdp_on_the_wire, CONFIG, "optim_grads_params", microbatches(), 2, tp=1
    )[0]
    padded = sum(units.values()) * bytes_
    assert sum(n for op, n in log if op == "all_gather") == 2 * PER_RANK * padded
    assert sum(n for op, n in log if op == "reduce_scatter") == PER_RANK * padded
