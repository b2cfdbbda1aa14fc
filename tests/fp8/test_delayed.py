"""Delayed scaling: Transformer Engine's update rule, written here from its definition
(transformer_engine/pytorch/fp8.py: the amax of the window or its newest entry, the history rolled
one place with its first row cleared, scale = fp8_max / amax / 2^margin kept where amax is 0 or not
finite), and the state's layout invariance: after training steps on ranks that are threads, every
rank's scales are one device's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.fp8 import delayed
from fmeg.fp8.delayed import DelayedState, updated
from fmeg.fp8.plan import Fp8Plan
from fmeg.fp8.recipe import Fp8Recipe
from fmeg.models import gpt
from fmeg.parallel.layout import Layout
from fmeg.parallel.spmd import run_threads
from fmeg.testing.curves import mesh_sizes, random_microbatches
from fmeg.training.parallel_step import initialized_state, train_iteration
from fmeg.training.step_settings import StepSettings


def te_update(history, scale, algo, margin, fp8_max):
    """One element at a time, as the definition reads."""
    length, sites, ops = history.shape
    new_history, new_scale = torch.zeros_like(history), torch.empty_like(scale)
    for s in range(sites):
        for o in range(ops):
            window = [float(history[i, s, o]) for i in range(length)]
            # torch's max: a NaN anywhere is the max
            nan = any(v != v for v in window)
            amax = (float("nan") if nan else max(window)) if algo == "max" else window[0]
            # the window rolled one place towards the front, the freed row cleared
            rolled = window[1:] + [window[0]] if length > 1 else window
            rolled[0] = 0.0
            new_history[:, s, o] = torch.tensor(rolled)
            ok = amax > 0 and amax != float("inf") and amax == amax
            new_scale[s, o] = float(fp8_max[o]) / amax / 2**margin if ok else scale[s, o]
    return new_history, new_scale


@settings(max_examples=50, deadline=None)
@given(
    length=st.integers(1, 5),
    algo=st.sampled_from(["max", "most_recent"]),
    margin=st.integers(0, 3),
    seed=st.integers(0, 2**16),
    special=st.sampled_from([None, 0.0, float("inf"), float("nan")]),
)
def test_the_update_is_transformer_engines(length, algo, margin, seed, special):
    gen = torch.Generator().manual_seed(seed)
    history = torch.rand(length, 4, 3, generator=gen) * 10
    if special is not None:
        history[:, 1, 2] = special
    scale = torch.rand(4, 3, generator=gen) + 0.5
    fp8_max = torch.tensor([448.0, 448.0, 57344.0])
    recipe = Fp8Recipe("hybrid", "delayed", history_len=length, algo=algo, margin=margin)
    got = updated(history, scale, recipe, fp8_max)
    want = te_update(history, scale, algo, margin, fp8_max)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=0, equal_nan=True)


CONFIG = gpt.GPTConfig(
    vocab_size=128, padded_vocab_size=128, max_seq_len=32, num_layers=2, hidden_size=128,
    num_heads=4,
)  # fmt: skip


def scales_after(mesh, layout, steps):
    """This rank's delayed-scaling scales after each of `steps` runner steps."""
    from fmeg.parallel.context import shard_batch
    from fmeg.training.stage_functions import model_parallel

    state = initialized_state(CONFIG, layout, mesh, seed=0, device="cpu")
    delayed = DelayedState(CONFIG.num_layers, 4, grad_factor=layout.dp)
    plan = Fp8Plan(Fp8Recipe("hybrid", "delayed", history_len=4, algo="max"), 2, state=delayed)
    context = model_parallel(layout, mesh).context
    mine = [
        shard_batch(mb, context)
        for mb in random_microbatches(CONFIG, 4)[mesh.coord("dp") :: layout.dp]
    ]
    settings = StepSettings(lr=1e-2, weight_decay=0.01, clip_grad=1.0, fp8=plan)
    out = []
    for _ in range(steps):
        train_iteration(state, mine, config=CONFIG, layout=layout, mesh=mesh, settings=settings)
        out.append(delayed.scale.clone())
    return out


LAYOUTS = {
    "dp2": Layout(dp=2, micro_batch_size=2),
    "pp2": Layout(pp=2, micro_batch_size=2),
    "tp2_sp": Layout(tp=2, sequence_parallel=True, micro_batch_size=2),
    "cp2": Layout(cp=2, micro_batch_size=2),
}


def scales(layout: Layout, steps: int = 2) -> list[list[torch.Tensor]]:
    world = layout.tp * layout.dp * layout.cp * layout.pp
    return run_threads(world, scales_after, layout, steps, **mesh_sizes(layout))


@pytest.fixture(scope="module")
def one_device():
    return scales(Layout(micro_batch_size=2))[0]


@pytest.mark.parametrize("name", ["dp2", "pp2"])
def test_every_ranks_scales_are_one_devices(name, one_device):
    """The amaxes of an iteration are reduced over every rank (data-parallel ranks hold other
    microbatches, pipeline ranks other layers), the gradients' in one device's units (the runner
    seeds each microbatch with 1 / its rank's microbatches: dp times one device's seed): the scales
    after each step are one device's, bitwise, on every rank."""
    for rank in scales(LAYOUTS[name]):
        for got, want in zip(rank, one_device):
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tp2_sp", "cp2"])
def test_split_tensors_scales_are_one_devices_but_for_rounding(name, one_device, monkeypatch):
    """tp and cp ranks hold parts of a tensor. Reduced, the first step's scales of x and w are one
    device's within one rounding of the last bit (a row-parallel sum split over the ranks rounds
    otherwise); g's within 2%: its amax is taken after backward GEMMs whose e5m2 (two mantissa bits)
    turns such a last-bit difference into another rounding. Without the reduction, x's and w's
    scales are another tensor's."""
    used = one_device[0] != 1.0
    for rank in scales(LAYOUTS[name], 1):
        rel = (rank[0] - one_device[0]).abs() / one_device[0]
        assert rel[:, :2].max() <= 2e-7 and rel[:, 2].max() <= 2e-2
    monkeypatch.setattr(delayed, "finish_step", _without_reduction(delayed.finish_step))
    for rank in scales(LAYOUTS[name], 1):
        rel = (rank[0] - one_device[0]).abs() / one_device[0]
        assert rel[:, :2][used[:, :2]].max() >= 0.05


def _without_reduction(finish_step):
    return lambda state, recipe, groups: finish_step(state, recipe, ())


def test_compiled_delayed_scaling_on_an_older_torch_is_refused_in_one_line(monkeypatch):
    """torch 2.11's compiled backward drops the gradients' amax records (seen on the lent H200):
    such a run is refused before it starts, naming the way out."""
    from fmeg.config.arguments import parse_args
    from fmeg.config.validation import validate

    argv = ["--fp8-format", "hybrid", "--compile", "--num-layers", "2"]
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    (line,) = validate(parse_args(argv, world_size=1), 1)
    assert line.startswith("--fp8-recipe delayed with compiled stages needs torch 2.13 or later")
    assert validate(parse_args([*argv, "--no-compile"], world_size=1), 1) == []
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert validate(parse_args(argv, world_size=1), 1) == []


def test_compiled_steps_keep_the_amaxes_eager_steps_keep():
    """The runner's compiled stage (inductor on the CPU) records the forward's and the backward's
    amaxes as the eager step does: the same losses and scales after three steps."""
    from fmeg.parallel.mesh import Mesh

    config = gpt.GPTConfig(
        vocab_size=128, padded_vocab_size=128, max_seq_len=32, num_layers=2, hidden_size=64,
        num_heads=4,
    )  # fmt: skip
    batch = random_microbatches(config, 1)
    out = []
    for compile in (None, "inductor"):
        torch._dynamo.reset()
        mesh, layout = Mesh.single(), Layout(micro_batch_size=2)
        state = initialized_state(config, layout, mesh, seed=0, device="cpu")
        delayed_state = DelayedState(2, 2)
        recipe = Fp8Recipe("hybrid", "delayed", history_len=2)
        plan = Fp8Plan(recipe, 2, state=delayed_state)
        s = StepSettings(lr=1e-2, weight_decay=0.0, clip_grad=1.0, fp8=plan, compile=compile)
        step = dict(config=config, layout=layout, mesh=mesh, settings=s)
        losses = [float(train_iteration(state, batch, **step)["loss"]) for _ in range(3)]
        out.append((losses, delayed_state.scale.clone()))
    (eager, eager_scale), (compiled, compiled_scale) = out
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled_scale[:, 2].ne(1.0).any()
    torch.testing.assert_close(compiled_scale, eager_scale, rtol=1e-5, atol=0)


def test_delayed_scaling_compiles_only_one_graph_per_stage_at_pp_1():
    """Another graph's forward between a compiled stage's forward and its backward (pipeline
    warm-up, per-layer graphs) would write the state the compiled backward kept: such stages run
    eagerly, and say so at start; tensor-wise scaling, which keeps no state, compiles at every
    layout."""
    from fmeg.training.stage_functions import stage_compilation

    delayed_plan = Fp8Plan(Fp8Recipe("hybrid", "delayed"), 2, state=DelayedState(2, 1))
    tensorwise = Fp8Plan(Fp8Recipe("hybrid", "tensorwise"), 2)
    assert stage_compilation("inductor", Layout(), False, delayed_plan) == ("inductor", True)
    assert stage_compilation("inductor", Layout(pp=2), False, delayed_plan) == (None, False)
    assert stage_compilation("inductor", Layout(dp=2), True, delayed_plan) == (None, False)
    assert stage_compilation("inductor", Layout(pp=2), False, tensorwise) == ("inductor", True)
    assert stage_compilation("inductor", Layout(dp=2), True, tensorwise) == ("inductor", False)
