"""Hybrid sharding's reduction (Megatron's distributed-optimizer instances): the groups are
Megatron's (an instance is dp x cp / N consecutive ranks of a dp-cp group, its replicas the ranks
that far apart); each rank's owned slice and replicated leaves after GradSync and ShardedGradSync
with replicas equal the mean over every rank, and on the wire each rank sends its buckets within
the instance and, across instances, one all-reduce of exactly what it holds."""

import pytest
import torch

from fmeg import tree
from fmeg.parallel.comm import RecordingGroup
from fmeg.parallel.data_parallel import GradSync
from fmeg.parallel.mesh import rank_groups
from fmeg.parallel.sharded_grads import ShardedGradSync
from fmeg.parallel.spmd import run_threads
from fmeg.parallel.zero import FlatBuffer


def test_instances_are_consecutive_ranks_of_the_data_parallel_group_and_replicas_far_apart():
    g = rank_groups(8, tp=2, cp=2, dp_outer=2)
    # dp x cp = 4 ranks per dp-cp group: instances of 2
    assert g["dp_cp"][0] == [0, 2, 4, 6]
    assert g["dp_cp_shard"][:2] == [[0, 2], [4, 6]]
    assert g["dp_cp_outer"][:2] == [[0, 4], [2, 6]]
    assert rank_groups(8, dp_outer=1)["dp_cp_shard"] == rank_groups(8)["dp_cp"]
    with pytest.raises(ValueError, match="instances \\(3\\) must divide dp x cp = 8 x 1"):
        rank_groups(8, dp_outer=3)


def grads(rank: int):
    gen = torch.Generator().manual_seed(rank)
    return {
        0: {
            "a": torch.randn(5, 3, generator=gen),
            "b": torch.randn(7, generator=gen),
            "tied": torch.randn(4, 2, generator=gen),
        }
    }


# a unit per leaf
UNIT = str


def hybrid_sync(mesh, sharded: bool):
    """This rank's owned slice and replicated leaf after the reduction, and what it sent."""
    inner = RecordingGroup(mesh.group("dp_cp_shard"))
    outer = RecordingGroup(mesh.group("dp_cp_outer"))
    mine = grads(mesh.rank)
    padded = FlatBuffer.of(mine, inner.size, UNIT).padded
    if sharded:
        sync = ShardedGradSync(
            mine,
            inner,
            torch.zeros(padded // inner.size),
            unit_of=UNIT,
            replicated=frozenset({"0.tied"}),
            divisor=4,
            replicas=outer,
        )
    else:
        sync = GradSync(
            mine,
            inner,
            owner_slices=True,
            replicated=frozenset({"0.tied"}),
            buffer=torch.zeros(padded),
            divisor=4,
            replicas=outer,
            unit_of=UNIT,
        )
    for path, g in tree.flatten(mine[0]).items():
        sync.ready(0, {path: g})
    sync.finish()
    return sync.owned().clone(), sync.leaf("0.tied").clone(), inner.log, outer.log


@pytest.mark.parametrize("sharded", [False, True], ids=["zero1", "optim_grads"])
def test_owned_slices_hold_the_mean_over_every_rank(sharded):
    out = run_threads(4, hybrid_sync, sharded, dp_outer=2)
    mean = {k: sum(grads(r)[0][k] for r in range(4)) / 4 for k in ("a", "b", "tied")}
    # units a (15 -> 16), b (7 -> 8), tied (8), each split in 2
    layout = FlatBuffer.of(grads(0), 2, UNIT)
    assert layout.units == ((0, 16), (16, 24), (24, 32))
    whole = layout.flatten({0: mean})
    for rank, (owned, tied, inner_log, outer_log) in enumerate(out):
        shard = rank % 2  # the rank's place in its instance
        torch.testing.assert_close(owned, layout.shard(whole, shard))
        # the tied leaf: this rank's half of it
        torch.testing.assert_close(tied, mean["tied"].reshape(-1).chunk(2)[shard])
        # across instances: what this rank holds, its 16 owned elements, nothing more
        assert [op for op, _ in outer_log] == ["all_reduce"] * len(outer_log)
        assert sum(n for _, n in outer_log) == 16 * 4, (rank, outer_log)
        # within the instance: each unit reduce-scattered
        assert [op for op, _ in inner_log] == ["reduce_scatter"] * 3


@pytest.mark.parametrize(
    "sizes", [dict(tp=2, ep=2, etp=1), dict(ep=2), dict(cp=2, ep=2), dict(ep=4, etp=1)]
)
def test_the_experts_instances_are_megatron_cores(monkeypatch, sizes):
    """expert_dp_shard / expert_dp_outer are the groups megatron-core's own
    create_hierarchical_groups makes of each expert data-parallel group (its intra- and
    inter-partial expert data-parallel groups), its create_group standing in as the ranks."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    monkeypatch.setattr(ps, "create_group", lambda ranks, **_: list(ranks))
    g = rank_groups(16, dp_outer=2, **sizes)
    for ranks in g["expert_dp"]:
        inner = len(ranks) // 2
        for rank in ranks:
            (intra, inter), _ = ps.create_hierarchical_groups(rank, ranks, [inner, 2])
            assert intra in g["expert_dp_shard"] and rank in intra
            assert inter in g["expert_dp_outer"] and rank in inter
    # a grid whose expert data-parallel groups the instances do not divide has none
    assert "expert_dp_shard" not in rank_groups(4, ep=4, dp_outer=2)
