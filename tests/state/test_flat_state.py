"""FlatState: the runner's persistent state in buffers allocated once. Its in-place step equals the
pure optax-style AdamW with clipping on trees; its host-side op count does not grow with the number
of leaves; it keeps 18 bytes per parameter at bf16 and 16 at fp32."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fmeg import optim, tree
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params


def config(layers):
    """Untied: a one-stage tree of a tied model holds the output copy, which the global norm counts
    once."""
    return gpt.GPTConfig.gpt2(
        vocab_size=64,
        max_seq_len=16,
        num_layers=layers,
        hidden_size=32,
        num_heads=4,
        tie_embeddings=False,
    )


def state_with_grads(layers, dtype=torch.float32, seed=0):
    c, mesh, layout = config(layers), Mesh.single(), Layout()
    params = shard_params(gpt.init(c, seed), c, layout, mesh)
    state = init_state(params, c, layout, mesh, compute_dtype=dtype)
    state.grad.normal_(generator=torch.Generator().manual_seed(seed))
    state.grad[state.flat.numel :] = 0.0  # the padding never holds gradient
    return params, state, mesh


@pytest.mark.parametrize("clip", [0.0, 1.0, 1e3])
def test_the_in_place_step_equals_the_pure_adamw_with_clipping(clip):
    params, state, mesh = state_with_grads(2)
    grads = state.flat.views(state.grad.clone())
    opt, adam = optim.adamw(), None
    for i in range(3):  # three steps: the moments and bias correction carry over
        want_g, clipped = optim.clip_by_global_norm(clip).update(grads, None)
        want_norm = clipped.norm
        adam = adam or opt.init(params)
        updates, adam = opt.update(
            want_g, adam, params, lr=torch.tensor(1e-2), weight_decay=torch.tensor(0.1)
        )
        params = optim.apply_updates(params, updates)
        state.grad.copy_(state.flat.flatten(grads))
        norm = state.step(mesh, lr=1e-2, weight_decay=0.1, clip_grad=clip)
        torch.testing.assert_close(norm, want_norm.double(), rtol=1e-6, atol=0)
        for (path, got), want in zip(tree.items(state.params), tree.tree_leaves(params)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=path)
    assert int(state.opt_state["adam"].count) == 3


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_issues_the_same_ops_at_4_and_16_layers(dtype):
    counts = {}
    for layers in (4, 16):
        _, state, mesh = state_with_grads(layers, dtype)
        with OpCount() as counted:
            state.step(mesh, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
        counts[layers] = counted.ops
    assert counts[4] == counts[16] and sum(counts[4].values()) <= 30, counts


@pytest.mark.parametrize("dtype, bytes_per_param", [(torch.float32, 16), (torch.bfloat16, 18)])
def test_persistent_bytes_per_parameter(dtype, bytes_per_param):
    _, state, _ = state_with_grads(2, dtype)
    assert state.bytes_per_parameter() == pytest.approx(bytes_per_param, rel=1e-3)


def test_a_bf16_gradient_buffer_steps_as_its_fp32_copy_would():
    """grad_dtype=bf16 (--grad-reduce-in-bf16; fp16 alike): the buffer is bf16, main_grad() copies
    the owned slice to fp32, and the step takes the same step as from an fp32 buffer holding the
    same values; 2 bytes saved, 4 spent."""
    _, fp32_grads, mesh = state_with_grads(2, torch.bfloat16)
    c, layout = config(2), Layout()
    params = shard_params(gpt.init(c, 0), c, layout, mesh)
    bf16_grads = init_state(
        params, c, layout, mesh, compute_dtype=torch.bfloat16, grad_dtype=torch.bfloat16
    )
    assert bf16_grads.grad.dtype == torch.bfloat16
    fp32_grads.grad.copy_(fp32_grads.grad.bfloat16())
    bf16_grads.grad.copy_(fp32_grads.grad)
    for state in (fp32_grads, bf16_grads):
        # the fp32 copy is made here, where unscaling happens
        assert state.main_grad().dtype == torch.float32
        state.norm = state.step(mesh, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    assert torch.equal(fp32_grads.norm, bf16_grads.norm)
    assert torch.equal(fp32_grads.main, bf16_grads.main) and torch.equal(
        fp32_grads.weights, bf16_grads.weights
    )
    assert bf16_grads.bytes_per_parameter() == pytest.approx(18 - 2 + 4, rel=1e-3)


def test_both_states_implement_the_one_protocol_and_share_what_loops_over_parts():
    """FlatState and ExpertSplitState are TrainingStates; the experts' state defines none of the
    methods that are the same call on each part (fmeg.state.protocol.Parts holds them once)."""
    from fmeg.state import ExpertSplitState, FlatState, Parts, TrainingState

    declared = {name for name in dir(TrainingState) if not name.startswith("_")}
    for cls in (FlatState, ExpertSplitState):
        assert declared <= set(dir(cls)), (cls, declared - set(dir(cls)))
    looped = {name for name in vars(Parts) if not name.startswith("_")} - {"parts"}
    assert looped and not looped & set(vars(ExpertSplitState)), looped & set(vars(ExpertSplitState))
    _, state, _ = state_with_grads(1)
    assert isinstance(state, TrainingState)


@pytest.mark.parametrize("sharding, dp", [("no_shard", 1), ("optim", 2)])
@pytest.mark.parametrize("name", ["muon", "soap", "adaptive_muon"])
def test_the_matrix_optimizers_keep_a_second_moment_for_the_other_leaves_only(name, sharding, dp):
    """Muon's and SOAP's matrices take no second moment from the flat buffers (adaptive Muon's
    do): nu holds the scalar optimizer's leaves' owned elements, 4 bytes per matrix element
    fewer."""
    from fmeg.config.optimizer_flags import OptimizerConfig
    from fmeg.optim.muon import MuonSettings

    c, layout = config(2), Layout(dp=dp, sharding=sharding)
    mesh = Mesh.build(0, dp, lambda ranks: None)
    params = shard_params(gpt.init(c, 0), c, layout, mesh)
    adaptive = name == "adaptive_muon"
    chosen = OptimizerConfig(
        name="muon" if adaptive else name,
        muon=MuonSettings(adaptive=(0.95, 1e-8) if adaptive else None),
    )
    state = init_state(params, c, layout, mesh, compute_dtype=torch.float32, optimizer=chosen)
    adam = init_state(params, c, layout, mesh, compute_dtype=torch.float32)
    group = state.optimizer.flat.group
    pieces = state._owned_pieces(params)
    matrix = sum(b - a for path, leaf, a, b, _ in pieces if group(path, leaf) == "muon")
    assert matrix > 0.8 * state.size
    if adaptive:
        assert state.nu.numel() == state.size
        return
    assert state.nu.numel() == state.size - matrix
    if name == "muon":  # SOAP keeps its factors and bases beside
        assert adam.persistent_bytes() - state.persistent_bytes() == 4 * matrix
    # the checkpoint's runs cover exactly the scalar leaves' owned elements
    _, runs = state.buffers()["nu"]
    assert sum(hi - lo for lo, hi, _ in runs) == state.nu.numel()
