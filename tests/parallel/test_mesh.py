"""rank_groups equals Megatron's RankGenerator; Mesh gives each rank its groups and coordinates."""

import itertools
import random

import pytest

from fmeg.parallel.mesh import Mesh, rank_groups
from fmeg.parallel.spmd import run_threads


def test_megatron_reference_example_tp2_pp4():
    g = rank_groups(16, tp=2, pp=4)
    assert g["tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["mp"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g["position_embedding"] == [[0], [1], [2], [3]]


def test_megatron_reference_example_tp4_cp2():
    assert rank_groups(8, tp=4, cp=2)["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=6, tp=4), "divisible by tp"),
        (dict(world_size=8, tp=2, ep=3), "expert tp"),
        (dict(world_size=8, tp=0), "tp must be a positive integer"),
        (dict(world_size=8, tp=2, pp=2, order="tp-dp"), "leaves out pp"),
        (dict(world_size=8, order="tp-cp-ep-dp-xx"), "axes must be"),
    ],
)
def test_invalid_sizes_say_what_divides_what(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rank_groups(**kwargs)


def test_every_group_partitions_the_world():
    g = rank_groups(32, tp=2, pp=2, cp=2, ep=1)
    for name, groups in g.items():
        if name in ("embedding", "position_embedding"):
            continue
        assert sorted(r for grp in groups for r in grp) == list(range(32)), name


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _random_configs(count, seed=0):
    rng = random.Random(seed)
    orders = ["-".join(p) for p in itertools.permutations(["tp", "cp", "ep", "dp", "pp"])]
    while count:
        world = rng.choice([1, 2, 4, 8, 12, 16, 24, 32, 64, 96, 128, 256, 512, 1024])
        tp = rng.choice(_divisors(world))
        pp = rng.choice(_divisors(world // tp))
        cp = rng.choice(_divisors(world // tp // pp))
        ep = 1 if cp > 1 else rng.choice(_divisors(world // pp))
        etp = rng.choice([None] + _divisors(world // pp // ep))
        if world % ((tp if etp is None else etp) * ep * pp) == 0:
            count -= 1
            yield world, tp, pp, cp, ep, etp, rng.choice(orders)


def test_rank_groups_equal_megatron_rank_generator_on_250_configurations():
    ps = pytest.importorskip("megatron.core.parallel_state")
    names = {
        "tp": ("dec", "tp"),
        "pp": ("dec", "pp"),
        "dp": ("dec", "dp"),
        "cp": ("dec", "cp"),
        "dp_cp": ("dec", "dp-cp"),
        "mp": ("dec", "tp-pp"),
        "tp_cp": ("dec", "tp-cp"),
        "tp_dp": ("dec", "tp-dp"),
        "tp_dp_cp": ("dec", "tp-dp-cp"),
        "ep": ("exp", "ep"),
        "expert_tp": ("exp", "tp"),
        "expert_dp": ("exp", "dp"),
        "tp_ep": ("exp", "tp-ep"),
        "tp_ep_pp": ("exp", "tp-ep-pp"),
    }
    compared = refused = 0
    for world, tp, pp, cp, ep, etp, order in _random_configs(250):
        etp_size = tp if etp is None else etp
        try:
            gens = {
                "dec": ps.RankGenerator(
                    tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=order
                ),
                "exp": ps.RankGenerator(
                    tp=etp_size, ep=ep, dp=world // (etp_size * ep * pp), pp=pp, cp=1, order=order
                ),
            }
            want = {k: gens[g].get_ranks(axes) for k, (g, axes) in names.items()}
            if gens["exp"].get_ranks("pp") != want["pp"]:
                raise RuntimeError("decoder and expert pipeline groups differ")
        except (RuntimeError, AssertionError):
            with pytest.raises(ValueError):
                rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
            refused += 1
            continue
        got = rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
        for k, v in want.items():
            assert got[k] == v, (world, tp, pp, cp, ep, etp, order, k)
        compared += 1
    assert compared >= 200, (compared, refused)


def test_single_rank_mesh_has_no_communicators():
    mesh = Mesh.single()
    assert mesh.group("tp") is None and mesh.coord("tp") == 0 and mesh.size("dp") == 1


def test_thread_mesh_coordinates_follow_the_groups():
    out = run_threads(
        8, lambda m: (m.coord("tp"), m.coord("pp"), m.coord("dp"), m.group("tp").size), tp=2, pp=2
    )
    assert out == [(r % 2, r // 4, (r // 2) % 2, 2) for r in range(8)]


def test_hierarchical_context_parallel_levels_are_megatrons():
    """--hierarchical-context-parallel-sizes 2 2 on a cp group g0 ... g3 (megatron-core's
    create_hierarchical_parallel_groups): the a2a level [g0, g1], [g2, g3], the p2p level [g0, g2],
    [g1, g3]."""
    g = rank_groups(8, tp=2, cp=4, cp_a2a=2)
    assert g["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["cp_a2a"] == [[0, 2], [4, 6], [1, 3], [5, 7]] and g["cp_p2p"] == [
        [0, 4],
        [2, 6],
        [1, 5],
        [3, 7],
    ]
    # one level: the ring is the whole cp group
    assert rank_groups(4, cp=4)["cp_p2p"] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="must divide cp = 4"):
        rank_groups(4, cp=4, cp_a2a=3)
