"""fmeg.testing.check_sharded passes correct sharded transforms and catches planted bugs: a
missing all-reduce in a parallel region's backward, and a wrong vmap rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
            match=rf"vjp on {backend}, rank 0, output: largest difference .* beyond rtol 1e-05",
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
