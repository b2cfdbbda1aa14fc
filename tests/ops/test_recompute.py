"""Activation recomputation (Megatron's --recompute-granularity full with methods uniform and block,
and selective): the loss and every gradient equal those of a run without it, bitwise (dropout masks
are counter-based, so the forward run again is the same forward), and a forward keeps far less for
backward."""

import ctypes
import gc

import pytest
import torch

from fmeg import tree
from fmeg.models import gpt
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.pipeline import execute, schedules
from fmeg.parallel.pipeline.execute import _forward

CONFIG = gpt.GPTConfig.llama(
    vocab_size=64,
    max_seq_len=16,
    num_layers=4,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=64,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


def microbatches(n=2, b=2, s=16):
    gen = torch.Generator().manual_seed(0)
    out = []
    for m in range(n):
        t = torch.randint(0, CONFIG.vocab_size, (b, s + 1), generator=gen)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "dropout_key": torch.tensor(m + 7)})
    return out


def loss_and_grads(recompute):
    params = {0: gp.split(gpt.init(CONFIG, 0), CONFIG, 1)[0]}
    fns = {0: gp.stage_segments(CONFIG, 0, 1, recompute=recompute)}
    actions = schedules.with_communication(schedules.one_f_one_b(1, 2))[0]
    return execute.execute(actions, fns, params, microbatches(), None, 1)


FULL = [
    ("full", "uniform", 1),
    ("full", "uniform", 2),
    ("full", "uniform", 4),
    ("full", "block", 1),
    ("full", "block", 3),
]


@pytest.mark.parametrize("recompute", [*FULL, ("selective", None, None)])
def test_recomputation_changes_no_number(recompute):
    want_loss, want = loss_and_grads(None)
    loss, got = loss_and_grads(recompute)
    assert torch.equal(loss, want_loss)
    for (path, a), b in zip(tree.items(got), tree.tree_leaves(want)):
        assert torch.equal(a, b), path


class _MallInfo(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def live_heap_bytes() -> int:
    """Bytes in use on the C heap (CPU tensors are malloc'd), from glibc's mallinfo2."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo
    gc.collect()
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def kept_after_forward(recompute, attention_dropout=0.0) -> int:
    """Bytes one microbatch's forward leaves alive for its backward (64-wide model, [4, 128]
    tokens)."""
    c = CONFIG.replace(
        max_seq_len=128,
        hidden_size=64,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=attention_dropout,
    )
    params = gp.split(gpt.init(c, 0), c, 1)[0]
    t = torch.randint(0, c.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "dropout_key": torch.tensor(3)}
    segments = gp.stage_segments(c, 0, 1, recompute=recompute)
    before = live_heap_bytes()
    alive = _forward(segments, params, None, batch)
    measured = live_heap_bytes() - before
    del alive
    return measured


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="needs glibc's mallinfo2"
)
def test_recomputation_keeps_far_less_for_backward():
    """Recomputing every layer keeps each layer's input [4, 128, 64] (128 KiB) instead of its
    attention and MLP intermediates: the forward leaves over 5x less alive; recomputing the first of
    four layers, about a quarter less."""
    kept_after_forward(None)  # first-call allocations (caches) out of the way
    none, every_layer, pairs, first = (
        kept_after_forward(r)
        for r in (None, ("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1))
    )
    assert every_layer * 5 < none and pairs < every_layer
    assert 0.6 * none < first < 0.9 * none


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="needs glibc's mallinfo2"
)
def test_selective_recomputation_drops_the_attention_probabilities():
    """With attention dropout the core keeps [4, 4, 128, 128] probabilities, masks and scores per
    layer (several MiB); recomputing the core keeps its q, k and v instead."""
    kept_after_forward(None, 0.1)
    none, selective = (
        kept_after_forward(None, 0.1),
        kept_after_forward(("selective", None, None), 0.1),
    )
    probabilities = 4 * 4 * 128 * 128 * 4 * 4  # one fp32 [b, n, s, s] tensor per layer, four layers
    assert none - selective > probabilities


# Megatron's --recompute-modules on a model that has every piece they name: MLA with q-lora, a dense
# first layer, then experts with a shared expert and a balance loss, and an MTP depth.
MODULES_CONFIG = gpt.GPTConfig.llama(
    vocab_size=64,
    max_seq_len=16,
    num_layers=3,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=4,
    ffn_hidden_size=64,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
    qk_norm=True,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=16,
    moe_layer_freq=(0, 1, 1),
    moe_shared_expert_intermediate_size=16,
    moe_aux_loss_coeff=1e-2,
    mtp_num_layers=1,
)


def module_loss_and_grads(config, modules):
    params = {0: gp.split(gpt.init(config, 0), config, 1)[0]}
    recompute = ("selective", None, None) if modules else None
    fns = {0: gp.stage_segments(config, 0, 1, recompute=recompute, modules=modules)}
    actions = schedules.with_communication(schedules.one_f_one_b(1, 2))[0]
    return execute.execute(actions, fns, params, microbatches(), None, 1)


@pytest.mark.parametrize("module", gp.SELECTIVE_MODULES)
def test_each_recompute_module_changes_no_number(module):
    """Each of Megatron's --recompute-modules gives the loss and every gradient of no recomputation
    (the norms' within rounding: their input's gradient sums its two paths in another order)."""
    want_loss, want = module_loss_and_grads(MODULES_CONFIG, ())
    loss, got = module_loss_and_grads(MODULES_CONFIG, (module,))
    assert torch.equal(loss, want_loss)
    for (path, a), b in zip(tree.items(got), tree.tree_leaves(want)):
        torch.testing.assert_close(
            a, b, rtol=1e-6, atol=1e-7, msg=path
        ) if module == "layernorm" else torch.testing.assert_close(a, b, rtol=0, atol=0, msg=path)


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="needs glibc's mallinfo2"
)
def test_each_recompute_module_keeps_less_for_backward():
    """Each module's recomputation leaves less alive after a forward than none, and all of them
    together less than any one (a 64-wide MLA + MoE model, [4, 128] tokens)."""
    c = MODULES_CONFIG.replace(
        max_seq_len=128,
        hidden_size=64,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.1,
        mtp_num_layers=None,
    )

    def kept(modules) -> int:
        params = gp.split(gpt.init(c, 0), c, 1)[0]
        t = torch.randint(0, c.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
        batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "dropout_key": torch.tensor(3)}
        segments = gp.stage_segments(
            c, 0, 1, recompute=("selective", None, None) if modules else None, modules=modules
        )
        before = live_heap_bytes()
        alive = _forward(segments, params, None, batch)
        measured = live_heap_bytes() - before
        del alive
        return measured

    kept(())
    none = kept(())
    each = {m: kept((m,)) for m in gp.SELECTIVE_MODULES}
    every = kept(gp.SELECTIVE_MODULES)
    assert all(v < none for v in each.values()), (none, each)
    assert every < min(each.values()), (every, each)
