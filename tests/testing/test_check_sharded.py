"""fmeg.testing.check_sharded passes correct sharded transforms and catches planted bugs: a
missing all-reduce in a parallel region's backward, a wrong vmap rule, an output of the wrong
shape; arguments it cannot check with are refused up front, each naming the argument."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.parallel import collectives as C
from fmeg.parallel.sharding import Partition
from fmeg.testing import ShardingMismatch, check_sharded
from harness import planted

MLP_RULES = (
    ("fc1.weight", Partition(-2)),
    ("fc1.bias", Partition(-1)),
    ("fc2.weight", Partition(-1)),
)


def mlp_params(hidden: int, ffn: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def linear(out, inp):
        return {"weight": torch.randn(out, inp, generator=g), "bias": torch.randn(out, generator=g)}

    return {"fc1": linear(ffn, hidden), "fc2": linear(hidden, ffn)}


@settings(max_examples=8, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4]),
    hidden=st.integers(1, 6),
    ffn_per_rank=st.integers(1, 3),
    seq=st.integers(1, 5),
    seed=st.integers(0, 10**6),
)
def test_the_tensor_parallel_mlp_passes_on_thread_ranks(world, hidden, ffn_per_rank, seq, seed):
    params = mlp_params(hidden, ffn_per_rank * 4, seed)
    x = torch.randn(2, seq, hidden, generator=torch.Generator().manual_seed(seed))
    checked = check_sharded(
        planted.mlp_sharded, planted.mlp_reference, params, x, MLP_RULES,
        world=world, backends=("threads",),
    )  # fmt: skip
    assert {c for c, _ in checked.compared} == {"forward", "grad", "vjp", "vmap"}
    assert [c for c, _ in checked.skipped] == ["jvp"]


def test_every_check_passes_on_gloo_processes_jvp_included():
    params, x = mlp_params(4, 8), torch.randn(2, 3, 4)
    checked = check_sharded(planted.mlp_sharded, planted.mlp_reference, params, x, MLP_RULES)
    assert ("jvp", "gloo") in checked.compared and ("vmap", "threads") in checked.compared
    check_sharded(
        planted.rows_sharded, planted.rows_reference, {"w": torch.randn(4, 3)},
        torch.randn(4, 3), (("w", Partition(0)),),
    )  # fmt: skip


def test_a_missing_backward_all_reduce_is_caught_with_its_leaf_and_size():
    params, x = mlp_params(4, 8), torch.randn(2, 3, 4)
    # its forward and its parameters' gradients are right: only x's gradient is partial
    check_sharded(
        planted.mlp_missing_backward_all_reduce, planted.mlp_reference, params, x, MLP_RULES,
        backends=("threads",), checks=("forward", "grad", "vmap"),
    )  # fmt: skip
    for backend in ("threads", "gloo"):
        with pytest.raises(
            ShardingMismatch,
            # the vjp's tensor is x's cotangent, not the output
            match=rf"vjp on {backend}, rank 0, x's cotangent: largest difference .* beyond rtol",
        ):
            check_sharded(
                planted.mlp_missing_backward_all_reduce, planted.mlp_reference, params, x,
                MLP_RULES, backends=(backend,),
            )  # fmt: skip


def test_a_wrong_vmap_rule_is_caught():
    params, x = {"w": torch.randn(4, 3)}, torch.randn(4, 3)
    rules = (("w", Partition(0)),)
    check_sharded(
        planted.rows_wrong_vmap, planted.rows_reference, params, x, rules,
        backends=("threads",), checks=("forward", "grad", "vjp"),
    )  # fmt: skip
    with pytest.raises(
        ShardingMismatch,
        # the batch of 3 gathered in place of the rows
        match=r"vmap on threads, rank 0, output: shape \(6, 2, 3\) where the reference's part is",
    ):
        check_sharded(planted.rows_wrong_vmap, planted.rows_reference, params, x, rules)


def test_token_ids_have_no_vjp_or_jvp_and_the_vocab_parallel_embedding_passes():
    table = torch.randn(8, 3)
    ids = torch.tensor([[0, 7, 3, 4], [5, 5, 1, 2]])
    checked = check_sharded(
        planted.embedding_sharded, planted.embedding_reference, {"weight": table}, ids,
        (("weight", Partition(-2)),), world=2,
    )  # fmt: skip
    assert {c for c, _ in checked.compared} == {"forward", "grad", "vmap"}
    assert any("x holds integers" in why for _, why in checked.skipped)


def test_unknown_checks_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        check_sharded(
            planted.rows_sharded, planted.rows_reference, {}, torch.ones(2), checks=["fwd"]
        )


def rows_wrong_shape_on_rank_1(mesh, p, x):
    """rows_sharded whose rank 1 drops a column of its output (module level: gloo imports it)."""
    out = planted.rows_sharded(mesh, p, x)
    return out[:, :-1] if mesh.coord("tp") == 1 else out


def rows_that_raise(mesh, p, x):
    raise RuntimeError("planted failure")


ROWS = {"w": torch.randn(4, 3)}


@pytest.mark.parametrize("backend", ["threads", "gloo"])
def test_a_sharded_output_of_the_wrong_shape_is_a_forward_mismatch_on_every_check(backend):
    # the forward is not among the checks asked for: the gradients cannot run on a wrong shape,
    # and no rank waits for rank 1 in a collective
    with pytest.raises(
        ShardingMismatch,
        match=rf"^check_sharded: forward on {backend}, rank 1, output: shape \(4, 2\) where the "
        r"reference's part is \(4, 3\)$",
    ):
        check_sharded(
            rows_wrong_shape_on_rank_1, planted.rows_reference, ROWS, torch.randn(4, 3),
            (("w", Partition(0)),), backends=(backend,), checks=("grad", "vjp"),
        )  # fmt: skip


def test_a_failed_gloo_run_leaves_the_next_check_a_working_pool():
    x, rules = torch.randn(4, 3), (("w", Partition(0)),)
    with pytest.raises(RuntimeError, match="planted failure"):
        check_sharded(rows_that_raise, planted.rows_reference, ROWS, x, rules, backends=("gloo",))
    check_sharded(planted.rows_sharded, planted.rows_reference, ROWS, x, rules, backends=("gloo",))


@pytest.mark.parametrize(
    "rules, error, message",
    [
        (
            (("w", Partition(-1)),),
            ValueError,
            r"rules cut w of shape \(4, 3\) along dim -1, of size 3, which does not split over "
            r"world=2",
        ),
        (
            (("w", Partition(2)),),
            ValueError,
            r"rules cut w of shape \(4, 3\) along dim 2, which it does not have",
        ),
        # one rule where a tuple of rules belongs
        (("w", Partition(0)), TypeError, r"rules must be \(pattern, Partition\) pairs.*got 'w'"),
    ],
    ids=["uneven", "no-such-dim", "not-pairs"],
)
def test_rules_that_do_not_cut_params_are_refused_before_any_rank_starts(rules, error, message):
    with pytest.raises(error, match=rf"^check_sharded: {message}"):
        check_sharded(planted.rows_sharded, planted.rows_reference, ROWS, torch.randn(4, 3), rules)


def test_a_rule_naming_no_leaf_is_named_with_the_leaves_there_are_when_the_check_fails():
    params, x = mlp_params(4, 8), torch.randn(2, 3, 4)
    # fc2 replicated by the typo: the sharded function cannot multiply its rows
    typo = (*MLP_RULES[:2], ("fc3", Partition(-1)))
    with pytest.raises(
        ValueError,
        match=r"^check_sharded: rules \['fc3'\] match no leaf of params \(its leaves: fc1.weight, "
        r"fc1.bias, fc2.weight, fc2.bias\), and then sharded_fn failed on threads: ",
    ):
        check_sharded(
            planted.mlp_sharded, planted.mlp_reference, params, x, typo, backends=("threads",)
        )
    # a rule set covering leaves these params lack (a model's, for a small configuration) passes
    check_sharded(
        planted.rows_sharded, planted.rows_reference, ROWS, torch.randn(4, 3),
        (("w", Partition(0)), ("layers.*.mlp.fc1.weight", Partition(-2))), backends=("threads",),
    )  # fmt: skip


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"world": 0}, r"world must be an integer >= 1, not 0"),
        (
            {"output": Partition(7)},
            r"output=Partition\(dim=7, axis='tp'\): dim 7 is out of range for the reference's "
            r"output of 3 dims \(shape \(2, 3, 4\)\)",
        ),
        (
            {"output": Partition(1)},
            r"output=Partition\(dim=1, axis='tp'\): dim 1 of the reference's output \(shape "
            r"\(2, 3, 4\)\) does not split over world=2",
        ),
    ],
    ids=["world-0", "output-dim-7", "output-uneven"],
)
def test_a_world_or_output_the_check_cannot_run_with_is_refused_naming_it(arguments, message):
    with pytest.raises(ValueError, match=rf"^check_sharded: {message}$"):
        check_sharded(
            planted.mlp_sharded, planted.mlp_reference, mlp_params(4, 8), torch.randn(2, 3, 4),
            MLP_RULES, backends=("threads",), **arguments,
        )  # fmt: skip


def test_an_output_partitioned_over_the_ranks_passes():
    # each rank keeps its rows: rows_sharded without the gather
    def rows_kept(mesh, p, x):
        return torch.tanh(C.scatter_to(x, mesh.group("tp"), 0) * p["w"])

    checked = check_sharded(
        rows_kept, planted.rows_reference, ROWS, torch.randn(4, 3), (("w", Partition(0)),),
        output=Partition(0), backends=("threads",),
    )  # fmt: skip
    assert {c for c, _ in checked.compared} == {"forward", "grad", "vjp", "vmap"}
