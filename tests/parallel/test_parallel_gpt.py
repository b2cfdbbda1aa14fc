"""The GPT under tensor parallelism (with and without sequence parallelism) has the single-device
loss and gradients, within fp32 rounding, for GPT-2, Llama (grouped-query), multi-latent attention,
multi-token prediction and GPT-OSS (sinks, sliding windows, the clamped quick-GEGLU) styles."""

import pytest
import torch

from harness import spmd_programs as P
from fmeg import tree
from fmeg.models import gpt, mtp
from fmeg.parallel import collectives as C
from fmeg.parallel.sharding import partition_of, shard, unshard
from fmeg.parallel.tensor import TensorParallel
from harness.parallel import run

CONFIGS = {
    "gpt2": gpt.GPTConfig.gpt2(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
    "llama": gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=48,
        hidden_dropout=0.1,
        attention_dropout=0.2,
    ),
    "mla": gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=48,
        qk_norm=True,
        multi_latent_attention=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=12,
        qk_pos_emb_head_dim=8,
        v_head_dim=10,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
    "mtp": gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=4,
        ffn_hidden_size=48,
        mtp_num_layers=2,
        mtp_loss_scaling_factor=0.5,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
    "gpt_oss": gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=48,
        activation="quick_geglu",
        bias=True,
        softmax_type="learnable",
        window_size=3,
        window_attn_skip_freq=2,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.05,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    ),
}


def batch_for(config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
    mask = (torch.rand(2, 8, generator=gen) > 0.2).float()
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask}


def check(backend, style, world, sp):
    config = CONFIGS[style]
    params, batch, key = gpt.init(config, 0), batch_for(config), torch.tensor(7)
    want_grads, want_loss = torch.func.grad_and_value(
        lambda p: mtp.loss(p, batch, config, key=key)
    )(params)
    results = run(
        backend, world, P.gpt_loss_and_grads, params, batch, config, key, sequence_parallel=sp
    )
    for loss, _ in results:
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    got = unshard([g for _, g in results], gpt.TP_RULES, "tp")
    for (path, g), w in zip(tree.items(got), tree.tree_leaves(want_grads)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=path)
    for r, (_, g) in enumerate(results):  # replicated gradients agree across ranks
        for path, leaf in tree.items(g):
            if partition_of(path, gpt.TP_RULES) is None:
                torch.testing.assert_close(leaf, tree.flatten(results[0][1])[path], msg=path)


@pytest.mark.parametrize("style", ["gpt2", "llama", "mla", "mtp", "gpt_oss"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_under_tp_on_thread_ranks(style, world, sp):
    check("threads", style, world, sp)


@pytest.mark.parametrize(
    "style, world, sp",
    [
        ("gpt2", 2, True),
        ("llama", 4, False),
        ("llama", 2, True),
        ("mla", 2, True),
        ("mtp", 2, True),
        ("gpt_oss", 2, True),
    ],
)
def test_gpt_under_tp_on_gloo(style, world, sp):
    check("gloo", style, world, sp)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_padded_vocabulary_under_tp_gives_the_unpadded_single_rank_loss_and_gradients(
    style, world
):
    """Megatron pads to a multiple of 128 * tp, so the padding depends on the layout; under TP (the
    vocabulary-parallel embedding and loss, some ranks holding padding only) the padded model must
    equal the unpadded one on one rank, and its padding rows must get no gradient."""
    plain = CONFIGS[style].replace(vocab_size=37)
    padded = plain.replace(padded_vocab_size=48 * world)  # the last rank holds padding rows only
    batch, key = batch_for(plain), torch.tensor(7)
    want_grads, want_loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, plain, key=key))(
        gpt.init(plain, 0)
    )
    results = run("threads", world, P.gpt_loss_and_grads, gpt.init(padded, 0), batch, padded, key)
    got = unshard([g for _, g in results], gpt.TP_RULES, "tp")
    for loss, _ in results:
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for path, g in tree.items(got):
        w = tree.flatten(want_grads)[path]
        if path in gpt.VOCAB_TABLES:
            assert not g[plain.vocab_size :].any(), path
            g = g[: plain.vocab_size]
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=path)

    def logits(mesh, params):  # this rank's vocabulary shard of the logits, gathered
        tp = TensorParallel(mesh.group("tp"))
        local = shard(params, gpt.TP_RULES, {"tp": (mesh.coord("tp"), world)})
        return C.gather_from(gpt.apply(local, batch["tokens"], padded, tp=tp), tp.group, -1)

    full = run("threads", world, logits, gpt.init(padded, 0))[0]
    probs = torch.softmax(full, -1)  # what sampling draws from: padding ids have probability 0
    assert full.shape[-1] == padded.padded_vocab_size and not probs[..., plain.vocab_size :].any()
    torch.testing.assert_close(
        full[..., : plain.vocab_size],
        gpt.apply(gpt.init(plain, 0), batch["tokens"], plain),
        rtol=1e-5,
        atol=1e-6,
    )


def test_shard_then_unshard_is_identity():
    config = CONFIGS["llama"]
    params = gpt.init(config, 1)
    shards = [shard(params, gpt.TP_RULES, {"tp": (r, 4)}) for r in range(4)]
    assert (
        shards[1]["layers"][0]["attn"]["qkv"]["weight"].shape[0]
        == params["layers"][0]["attn"]["qkv"]["weight"].shape[0] // 4
    )
    assert shards[1]["layers"][0]["mlp"]["fc1"]["weight"].shape == (2, 12, 32)
    back = unshard(shards, gpt.TP_RULES, "tp")
    assert all(torch.equal(a, b) for a, b in zip(tree.tree_leaves(back), tree.tree_leaves(params)))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_kv_heads=2), "num_kv_heads"),
        (dict(vocab_size=60, padded_vocab_size=66), "padded_vocab_size"),
        (dict(ffn_hidden_size=50), "ffn"),
    ],
)
def test_layouts_that_do_not_split_are_refused_naming_the_field(kwargs, field):
    config = CONFIGS["llama"].replace(**kwargs)
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}.*tensor-parallel size 4"):
        gpt.check_tensor_parallel(config, 4)


def test_the_model_refuses_kv_heads_that_do_not_split_even_when_the_rows_do():
    # 2 kv groups of (2 + 2) * 4 rows = 32 qkv rows split over 4 ranks, but a group would be cut in
    # two.
    config = gpt.GPTConfig.llama(
        vocab_size=64,
        max_seq_len=8,
        num_layers=1,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=16,
    )
    params, batch = gpt.init(config, 0), batch_for(config)
    with pytest.raises(RuntimeError, match=r"GPTConfig\.num_kv_heads=2 must be divisible"):
        run("threads", 4, P.gpt_loss_and_grads, params, batch, config, None)
