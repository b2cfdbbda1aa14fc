"""--fp8-param-gather (fmeg.fp8.param_gather): the distributed optimizer's all-gather of the
weights moves one byte per element of an FP8 linear's weight. On ranks that are threads, every
rank's compute weights after the gather are the owned chunks' values where no FP8 piece lies and,
inside each piece, its FP8 numbers with the one-device scale (the amax of the whole piece, whose
chunks several ranks own), written dequantized; and the runner's curve with the flag is bitwise
the one without (the forward quantizes the dequantized weight to the same FP8 numbers)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.fp8.param_gather import Fp8ParamGather, Fp8Piece
from fmeg.fp8.recipe import E4M3, Fp8Recipe
from fmeg.parallel.spmd import run_threads


def layout(seed: int, units: int, dp: int):
    """Units of random lengths (multiples of dp) and pieces inside them that cross the chunks."""
    gen = torch.Generator().manual_seed(seed)
    bounds, pieces, at = [], [], 0
    for _ in range(units):
        size = dp * int(torch.randint(3, 40, (), generator=gen))
        cuts = sorted(torch.randint(at, at + size, (4,), generator=gen).tolist())
        pieces += [Fp8Piece(a, b - a) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
        bounds.append((at, at + size))
        at += size
    return bounds, pieces, at


def gathered(mesh, values, bounds, pieces, dtype):
    dp, rank = mesh.size("dp"), mesh.coord("dp")
    starts = [0]
    for a, b in bounds[:-1]:
        starts.append(starts[-1] + (b - a) // dp)
    owned = torch.cat([values[a + rank * (b - a) // dp :][: (b - a) // dp] for a, b in bounds])
    group = mesh.group("dp")
    gather = Fp8ParamGather(
        pieces, tuple(bounds), tuple(starts), dp, rank, dtype, Fp8Recipe(), (group,)
    )
    weights = torch.zeros(values.numel(), dtype=dtype)
    gather.refresh(owned, weights, group)
    return weights, gather.sent, gather.unpacked


def expected(values, pieces, dtype):
    out = values.to(dtype).clone()
    for p in pieces:
        whole = values[p.start : p.start + p.numel].to(dtype).float()
        scale = (448.0 / whole.abs().max().double().clamp(min=1e-12)).float()
        q = (whole * scale).clamp(-448, 448).to(E4M3).float() / scale
        out[p.start : p.start + p.numel] = q.to(dtype)
    return out


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    units=st.integers(1, 3),
    dp=st.sampled_from([2, 4]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_every_rank_holds_the_fp8_numbers_of_each_piece_and_the_rest_as_it_was(
    seed, units, dp, dtype
):
    bounds, pieces, total = layout(seed, units, dp)
    values = torch.randn(total, generator=torch.Generator().manual_seed(seed)) * 3
    want = expected(values, pieces, dtype)
    for weights, sent, unpacked in run_threads(dp, gathered, values, bounds, pieces, dtype):
        assert torch.equal(weights, want)
        assert (sent, unpacked) == wire_bytes(bounds, pieces, dp, dtype)


def wire_bytes(bounds, pieces, dp, dtype):
    """(bytes all-gathered, bytes in the compute dtype): each rank sends its chunk's FP8 elements
    a byte each, then from a whole element on, its other elements; every rank as many bytes as
    the fullest."""
    size = torch.empty((), dtype=dtype).element_size()
    up = lambda n: -(-n // size) * size  # noqa: E731
    sent = 0
    for a, b in bounds:
        chunk, per_rank = (b - a) // dp, []
        for r in range(dp):
            lo, hi = a + r * chunk, a + (r + 1) * chunk
            fp8 = sum(max(0, min(hi, p.start + p.numel) - max(lo, p.start)) for p in pieces)
            per_rank.append(up(fp8) + (chunk - fp8) * size)
        sent += dp * up(max(per_rank))
    return sent, sum(b - a for a, b in bounds) * size


ZERO1 = ["--use-distributed-optimizer"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
TENSORWISE = ["--fp8-recipe", "tensorwise"]


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(ZERO1, id="zero1_delayed"),
        pytest.param([*ZERO1, *TENSORWISE], marks=pytest.mark.slow, id="zero1_tensorwise"),
        pytest.param([*ZERO1, "--bf16"], marks=pytest.mark.slow, id="zero1_bf16"),
        pytest.param(FSDP, id="fsdp_delayed"),
        pytest.param([*FSDP, *TENSORWISE], marks=pytest.mark.slow, id="fsdp_tensorwise"),
        pytest.param(
            [*FSDP, "--bf16", "--log-params-norm"], marks=pytest.mark.slow, id="fsdp_bf16"
        ),
    ],
)
def test_the_runners_curve_with_fp8_gathers_is_the_one_without(tmp_path, flags):
    """The distributed optimizer's gather after the step and Megatron-FSDP's before each use
    (their weights' norm, --log-params-norm, from a gather in the compute dtype)."""
    from harness.runner import run_recipe

    base = ["--fp8-format", "hybrid", "--log-interval", "1", *flags]
    plain, _ = run_recipe(tmp_path, "plain", 2, base)
    fp8, stdout = run_recipe(tmp_path, "fp8", 2, [*base, "--fp8-param-gather"])
    assert "all-gathers the FP8 weights as FP8 bytes" in stdout
    norms = [[r.get("params_norm") for r in records] for records in (plain, fp8)]
    assert norms[0] == norms[1]
    losses = [[r["lm_loss"] for r in records if "lm_loss" in r] for records in (plain, fp8)]
    assert len(losses[0]) == 20 and losses[0] == losses[1]


def experts_pieces(mesh, config, layout):
    from types import SimpleNamespace

    from fmeg.fp8.delayed import DelayedState
    from fmeg.fp8.plan import Fp8Plan
    from fmeg.training.fp8_state import fp8_weight_pieces
    from fmeg.training.parallel_step import initialized_state

    state = initialized_state(config, layout, mesh, seed=0, device="cpu")
    delayed = DelayedState(config.num_layers, 1, num_experts=4)
    plan = Fp8Plan(Fp8Recipe("hybrid", "delayed"), config.num_layers, param_gather=True)
    cfg = SimpleNamespace(model=config, layout=layout)
    rank = mesh.coord("ep")
    dense = fp8_weight_pieces(state.dense, cfg, plan, delayed, 0)
    experts = fp8_weight_pieces(state.experts, cfg, plan, delayed, rank)
    return rank, dense, experts, state.experts.leaf_ranges, delayed


def test_each_experts_matrix_is_a_piece_with_its_own_row():
    """Under expert parallelism each rank's experts' weights [2 local, ...] give one piece per
    expert, numbered among all experts; the dense part's linears one piece each."""
    from fmeg.models import gpt
    from fmeg.parallel.layout import Layout
    from fmeg.testing.curves import mesh_sizes

    config = gpt.GPTConfig.llama(
        vocab_size=64, padded_vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32,
        num_heads=4, num_kv_heads=2, ffn_hidden_size=64, num_experts=4, moe_router_topk=2,
    )  # fmt: skip
    layout = Layout(dp=2, ep=2, micro_batch_size=2, sharding="optim")
    for rank, dense, experts, ranges, delayed in run_threads(
        2, experts_pieces, config, layout, **mesh_sizes(layout)
    ):
        assert [p.row for p in dense] == [
            delayed.row(i, s) for i in (0, 1) for s in ("qkv", "proj")
        ]
        want = []
        for layer in (0, 1):
            for site in ("fc1", "fc2"):
                start, numel = ranges[f"0.layers.{layer}.mlp.experts.{site}.weight"]
                for e in range(2):
                    row = delayed.expert_row(layer, 2 * rank + e, site)
                    want.append(Fp8Piece(start + e * numel // 2, numel // 2, row))
        assert experts == want


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_a_run_with_fp8_gathers_resumes_on_its_curve(tmp_path, dtype):
    """Saved at iteration 10 (the fp32 master apart from the FP8-valued weights), resumed: the
    20 iterations are the uninterrupted run's, bitwise."""
    from harness.runner import run_recipe

    flags = [*dtype, "--fp8-format", "hybrid", "--use-distributed-optimizer", "--fp8-param-gather"]
    whole, _ = run_recipe(tmp_path, "whole", 2, flags)
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "10"]
    first, _ = run_recipe(tmp_path, "first", 2, [*flags, *ckpt, "--exit-interval", "10"])
    second, stdout = run_recipe(tmp_path, "second", 2, [*flags, "--load", str(tmp_path / "ckpt")])
    assert "resumed from" in stdout
    losses = lambda records: [r["lm_loss"] for r in records if "lm_loss" in r]  # noqa: E731
    assert losses(first) + losses(second) == losses(whole)
