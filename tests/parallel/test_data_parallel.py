"""GradSync: bucketed data-parallel gradient means equal the per-leaf mean, whatever the bucket
size, the order leaves arrive in, the group size and ZeRO's owner slices; buckets start before the
last leaf arrives; and a segmented backward hands every gradient over exactly once."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import spmd_programs as P
from fmeg import tree
from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.data_parallel import GradSync, _buckets, _unit_buckets
from fmeg.parallel.pipeline import execute, schedules
from fmeg.parallel.zero import FlatBuffer
from harness.parallel import run


def per_rank_grads(shapes_by_stage, dp, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            s: {"w": [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]}
            for s, shapes in shapes_by_stage.items()
        }
        for _ in range(dp)
    ]


def check(results, per_rank, owner_slices, replicated, dp, units="leaf"):
    want = tree.tree_map(lambda *xs: sum(xs) / dp, *per_rank)
    layout = FlatBuffer.of(want, dp, P.UNITS[units] if owner_slices else None)
    flat_want = layout.flatten(want, torch.float64)
    for rank, (got, owned, _, _) in enumerate(results):
        # every rank's owned elements (its chunk of every unit) are the mean
        torch.testing.assert_close(owned, layout.shard(flat_want, rank).to(owned.dtype))
        for path, g in tree.items(got) if not owner_slices else ():
            torch.testing.assert_close(g, tree.flatten(want)[path], msg=path)


shapes = st.lists(
    st.lists(st.integers(1, 7), min_size=1, max_size=2).map(tuple), min_size=1, max_size=5
)


@given(
    stage_shapes=st.lists(shapes, min_size=1, max_size=2),
    dp=st.sampled_from([2, 3, 4]),
    owner_slices=st.booleans(),
    bucket_numel=st.integers(1, 60),
    reverse=st.booleans(),
    units=st.sampled_from(["leaf", "stage"]),
    data=st.data(),
)
def test_bucketed_mean_equals_the_per_leaf_mean_on_thread_ranks(
    stage_shapes, dp, owner_slices, bucket_numel, reverse, units, data
):
    per_rank = per_rank_grads(dict(enumerate(stage_shapes)), dp, seed=len(stage_shapes))
    paths = [path for path, _ in tree.items(per_rank[0])]
    # tied copies are units of their own
    alone = owner_slices and units == "leaf"
    replicated = data.draw(st.sets(st.sampled_from(paths), max_size=2)) if alone else set()
    order = [
        (int(p.split(".")[0]), p.split(".", 1)[1]) for p in (reversed(paths) if reverse else paths)
    ]
    results = run(
        "threads",
        dp,
        P.grad_sync_mean,
        per_rank,
        owner_slices,
        sorted(replicated),
        bucket_numel,
        order,
        None,
        units,
        tp=1,
    )
    check(results, per_rank, owner_slices, replicated, dp, units)
    if owner_slices:
        # one reduce-scatter per unit
        layout = FlatBuffer.of(per_rank[0], dp, P.UNITS[units])
        assert results[0][2] == ["reduce_scatter"] * len(layout.units)


@given(
    stage_shapes=st.lists(shapes, min_size=1, max_size=2),
    dp=st.sampled_from([2, 3, 4]),
    units=st.sampled_from(["leaf", "stage"]),
    microbatches=st.integers(1, 3),
    reverse=st.booleans(),
    data=st.data(),
)
def test_sharded_gradients_hold_the_slice_of_the_mean_on_thread_ranks(
    stage_shapes, dp, units, microbatches, reverse, data
):
    """optim_grads: each microbatch's units reduce-scattered add up to each rank's chunks of the
    mean; leaf() gives a replicated leaf's (a unit of its own) owned elements of the mean."""
    per_rank = per_rank_grads(dict(enumerate(stage_shapes)), dp, seed=len(stage_shapes))
    paths = [path for path, _ in tree.items(per_rank[0])]
    alone = units == "leaf"
    replicated = data.draw(st.sets(st.sampled_from(paths), max_size=2)) if alone else set()
    order = [
        (int(p.split(".")[0]), p.split(".", 1)[1]) for p in (reversed(paths) if reverse else paths)
    ]
    results = run(
        "threads",
        dp,
        P.sharded_grad_sync_mean,
        per_rank,
        sorted(replicated),
        units,
        order,
        microbatches,
        tp=1,
    )
    check([(None, owned, None, None) for owned, _ in results], per_rank, True, set(), dp, units)
    mean = tree.tree_map(lambda *xs: sum(xs) / dp, *per_rank)
    layout = FlatBuffer.of(mean, dp, P.UNITS[units])
    flat = layout.flatten(mean, torch.float64)
    for rank, (_, tied) in enumerate(results):
        for path, g in tied.items():
            start = layout.starts[paths.index(path)]
            pieces = layout.owned_pieces(start, tree.flatten(mean)[path].numel(), rank)
            held = torch.cat([flat[:0]] + [flat[a:b] for a, b, _ in pieces])
            torch.testing.assert_close(g, held, msg=path)


def test_sharded_gradients_on_gloo():
    per_rank = per_rank_grads({0: [(10, 10), (10,), (3,)], 1: [(20, 5), (7, 7)]}, 2, seed=0)
    paths = [path for path, _ in tree.items(per_rank[0])]
    order = [(int(p.split(".")[0]), p.split(".", 1)[1]) for p in reversed(paths)]
    results = run("gloo", 2, P.sharded_grad_sync_mean, per_rank, ["0.w.1"], "leaf", order, 2, tp=1)
    check([(None, owned, None, None) for owned, _ in results], per_rank, True, set(), 2)


@pytest.mark.parametrize("owner_slices", [False, True])
def test_bucketed_mean_on_gloo(owner_slices):
    per_rank = per_rank_grads({0: [(10, 10), (10,), (3,)], 1: [(20, 5), (7, 7)]}, 2, seed=0)
    paths = [path for path, _ in tree.items(per_rank[0])]
    order = [(int(p.split(".")[0]), p.split(".", 1)[1]) for p in reversed(paths)]
    replicated = ["0.w.1"] if owner_slices else []
    results = run("gloo", 2, P.grad_sync_mean, per_rank, owner_slices, replicated, 40, order, tp=1)
    check(results, per_rank, owner_slices, set(replicated), 2)
    ops = results[0][2]
    if owner_slices:
        # a unit per leaf, each reduce-scattered
        assert ops == ["reduce_scatter"] * 5
    else:
        assert set(ops) == {"all_reduce"} and len(ops) > 2


@pytest.mark.parametrize("owner_slices", [False, True])
def test_a_bf16_buffer_reduces_in_bf16_on_gloo(owner_slices):
    """--grad-reduce-in-bf16: given a bf16 buffer, the gradients are reduced and averaged in bf16
    (bf16's (a + b) / 2 on two ranks; tests/test_mixed_precision shows the curve moving off the
    fp32-reduced one)."""
    per_rank = [
        tree.tree_map(lambda x: x.bfloat16(), g)
        for g in per_rank_grads({0: [(10, 10), (10,)], 1: [(20, 5)]}, 2, seed=1)
    ]
    paths = [path for path, _ in tree.items(per_rank[0])]
    order = [(int(p.split(".")[0]), p.split(".", 1)[1]) for p in reversed(paths)]
    results = run(
        "gloo", 2, P.grad_sync_mean, per_rank, owner_slices, [], 40, order, torch.bfloat16, tp=1
    )
    layout = FlatBuffer.of(per_rank[0], 2, P.UNITS["leaf"] if owner_slices else None)
    flat = [layout.flatten(g, torch.bfloat16) for g in per_rank]
    want = (flat[0] + flat[1]) / 2
    for rank, (_, owned, _, _) in enumerate(results):
        shard = layout.shard(want, rank)
        assert owned.dtype == torch.bfloat16 and torch.equal(owned, shard)


def test_buckets_of_size_and_of_units():
    """Without ZeRO, buckets of about bucket_numel (reversed, cut around replicated leaves); with
    ZeRO, one per unit, each a multiple of dp."""
    sizes, padded = [100, 10, 100, 3, 49], 264
    assert _buckets(sizes, padded, set(), 120) == [
        (110, 264, [2, 3, 4], False),
        (0, 110, [0, 1], False),
    ]
    assert [(a, b) for a, b, _, _ in _buckets(sizes, padded, {0}, 1000)] == [(100, 264), (0, 100)]
    params = {0: {"a": torch.zeros(10), "b": torch.zeros(5)}, 1: {"c": torch.zeros(3)}}
    layout = FlatBuffer.of(params, 4, lambda path: path.split(".")[0])
    assert layout.units == ((0, 16), (16, 20)) and layout.starts == (0, 10, 16)
    assert _unit_buckets(layout) == [(0, 16, [0, 1], True), (16, 20, [2], True)]
    with pytest.raises(ValueError, match="replicated leaf 0.w.0 shares its unit"):
        GradSync(
            {0: {"w": [torch.zeros(2), torch.zeros(3)]}},
            None,
            owner_slices=True,
            replicated=frozenset({"0.w.0"}),
            unit_of=lambda path: path.split(".")[0],
        )


def test_a_leaf_given_twice_or_never_is_an_error():
    params = {0: {"a": torch.zeros(3), "b": torch.zeros(2)}}
    sync = GradSync(params, None)
    sync.ready(0, {"a": torch.ones(3)})
    with pytest.raises(RuntimeError, match="given after its final one"):
        sync.ready(0, {"a": torch.ones(3)})
    with pytest.raises(RuntimeError, match="no gradient for"):
        sync.finish()


def test_segmented_backward_starts_buckets_before_the_backward_ends():
    """A one-stage GPT on one rank: with small buckets, the first bucket starts while most leaves
    are still being differentiated, and every gradient equals the unsegmented one."""
    config = gpt.GPTConfig.gpt2(
        vocab_size=32, max_seq_len=8, num_layers=4, hidden_size=16, num_heads=2
    )
    params = {0: gp.split(gpt.init(config, 0), config, 1)[0]}
    gen = torch.Generator().manual_seed(0)
    mbs = [
        {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, 8)}
        for t in (torch.randint(0, 32, (2, 9), generator=gen) for _ in range(2))
    ]
    actions = schedules.with_communication(schedules.gpipe(1, 2))[0]
    sync = GradSync(params, None, bucket_numel=1)
    execute.execute(
        actions, {0: gp.stage_segments(config, 0, 1)}, params, mbs, None, 1, grads_into=sync
    )
    sync.finish()
    _, whole = execute.execute(actions, {0: gp.stage_fn(config, 0, 1)}, params, mbs, None, 1)
    leaves = len(tree.tree_leaves(params))
    # the head's leaves came first, the rest still pending
    assert sync.started_with_pending[0] >= leaves - 4
    assert sorted(sync.started_with_pending, reverse=True) == sync.started_with_pending
    for (path, got), want in zip(tree.items(sync.tree()), tree.tree_leaves(whole)):
        assert torch.equal(got, want), path
