"""Multi-token prediction (fmeg.models.mtp) against megatron-core's GPTModel with its
MultiTokenPredictionBlock on the same weights, and its shifts and objective on their own."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import megatron_gpt
from fmeg import tree
from fmeg.models import gpt, mtp
from fmeg.parallel.context import NO_CP
from harness.parallel import gloo


def mtp_config(**overrides) -> gpt.GPTConfig:
    base = dict(
        vocab_size=64,
        max_seq_len=32,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        mtp_num_layers=2,
        mtp_loss_scaling_factor=0.3,
        init_std=0.1,
    )
    return gpt.GPTConfig(**{**base, **overrides})


def batch_of(config, b=2, s=16, seed=0, masked=True) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s + 1), generator=gen)
    mask = (torch.rand(b, s, generator=gen) > 0.25).float() if masked else torch.ones(b, s)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


@pytest.mark.parametrize("depths", [1, 2])
def test_mtp_equals_megatron_cores_multi_token_prediction(depths):
    pytest.importorskip("megatron.core")
    config = mtp_config(mtp_num_layers=depths)
    params = gpt.init(config, 5)
    with torch.no_grad():  # norms away from one, so that a misplaced norm shows
        for path, leaf in tree.items(params):
            if "norm" in path:
                leaf.add_(
                    0.2
                    * torch.randn(leaf.shape, generator=torch.Generator().manual_seed(len(path)))
                )
    batch = batch_of(config)
    want_lm, want_depths, want_grads = gloo(1).run(
        megatron_gpt.megatron_gpt, params, batch, config, tp=1
    )[0]
    lm, grads = torch.func.grad_and_value(lambda p: mtp.loss(p, batch, config))(params)[::-1]
    assert abs(lm.item() - want_lm) < 1e-5
    assert mtp.values(params, batch, config) == pytest.approx(want_depths, abs=1e-5)
    for path, g in tree.items(grads):
        torch.testing.assert_close(g, want_grads[path], atol=1e-5, rtol=1e-4, msg=path)


def shifted_by_document(x, documents):
    """The reference: each document of each row moved one place left on its own, 0 at its last
    place."""
    out = torch.zeros_like(x)
    for row, cu in enumerate(documents.tolist()):
        for start, end in zip(cu[:-1], cu[1:]):
            out[row, start : end - 1] = x[row, start + 1 : end]
    return out


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_shift_keeps_each_packed_document_to_itself(data):
    s = data.draw(st.integers(2, 12))
    rows = []
    for _ in range(2):
        cuts = sorted(data.draw(st.sets(st.integers(1, s - 1), max_size=4)))
        # padded to one width, as the loader pads cu_seqlens
        rows.append([0, *cuts, s] + [s] * (5 - len(cuts)))
    documents = torch.tensor(rows)
    x = torch.randint(1, 50, (2, s))
    assert torch.equal(mtp.shift_left(x, documents, NO_CP), shifted_by_document(x, documents))
    assert torch.equal(
        mtp.shift_left(x, None, NO_CP), shifted_by_document(x, torch.tensor([[0, s], [0, s]]))
    )


def _cp_shift(mesh, x, documents):
    from fmeg.parallel.context import ContextParallel, shard_sequence

    cp = ContextParallel(mesh.group("cp"))
    return mtp.shift_left(shard_sequence(x, cp), documents, cp), shard_sequence(
        mtp.shift_left(x, documents, NO_CP), cp
    )


def test_a_context_parallel_shift_is_the_whole_sequences_on_this_ranks_tokens():
    x = torch.arange(1, 33).reshape(2, 16)
    documents = torch.tensor([[0, 5, 11, 16], [0, 16, 16, 16]])
    for got, want in gloo(2).run(_cp_shift, x, documents, cp=2):
        assert torch.equal(got, want)


def test_the_objectives_value_is_the_lm_loss_and_its_gradient_adds_the_scaled_depth_losses():
    config = mtp_config()
    params, batch = gpt.init(config, 1), batch_of(config, seed=2)
    lm = gpt.loss(params, batch, config)
    assert torch.equal(mtp.loss(params, batch, config), lm)

    def spelled_out(p):
        x = gpt.hidden_states(p, batch["tokens"], config)
        depths = mtp.depth_losses(p, x, batch, config)
        return gpt.loss(p, batch, config) + config.mtp.loss_scaling_factor * sum(depths) / len(
            depths
        )

    want = torch.func.grad(spelled_out)(params)
    for (path, g), w in zip(
        tree.items(torch.func.grad(lambda p: mtp.loss(p, batch, config))(params)),
        tree.tree_leaves(want),
    ):
        torch.testing.assert_close(g, w, msg=path)


def test_depths_are_layers_numbered_after_the_decoder_of_the_last_layers_kind():
    config = mtp_config(num_experts=4, moe_layer_freq=(0, 1), moe_ffn_hidden_size=16)
    params = gpt.init(config, 0)
    assert (
        "router" in params["mtp"][0]["layer"]["mlp"] and "router" not in params["layers"][0]["mlp"]
    )
    assert params["mtp"][0]["eh_proj"]["weight"].shape == (32, 64)
    dense = gpt.init(config.replace(moe_layer_freq=(1, 0)), 0)
    assert "fc1" in dense["mtp"][1]["layer"]["mlp"]
    with pytest.raises(
        ValueError, match="GPTConfig.mtp_num_layers: multi-token prediction needs rope"
    ):
        mtp_config(position="learned")
