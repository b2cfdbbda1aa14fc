"""from_hf / to_hf: fmeg and transformers compute the same function, and the same gradients."""

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg import tree
from fmeg.interop import hf
from fmeg.models import gpt

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


@st.composite
def gpt2_models(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    config = transformers.GPT2Config(
        n_layer=draw(st.integers(1, 3)),
        n_head=heads,
        n_embd=heads * draw(st.sampled_from([4, 8])),
        vocab_size=draw(st.integers(5, 70)),
        n_positions=draw(st.integers(8, 24)),
        n_inner=draw(st.sampled_from([None, 24])),
        tie_word_embeddings=draw(st.booleans()),
        activation_function=draw(st.sampled_from(["gelu_new", "gelu"])),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(draw(st.integers(0, 10_000)))
    return transformers.GPT2LMHeadModel(config).eval()


@st.composite
def llama_models(draw):
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    config = transformers.LlamaConfig(
        num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_size=heads * draw(st.sampled_from([4, 8])),
        intermediate_size=draw(st.sampled_from([16, 40])),
        vocab_size=draw(st.integers(5, 70)),
        max_position_embeddings=draw(st.integers(8, 24)),
        tie_word_embeddings=draw(st.booleans()),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
        },
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(draw(st.integers(0, 10_000)))
    model = transformers.LlamaForCausalLM(config).eval()
    # Hugging Face initialises norms to 1; perturb them so a wrong mapping shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def tokens_for(model, seed):
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    seq = min(getattr(c, "n_positions", None) or c.max_position_embeddings, 12)
    return torch.randint(0, c.vocab_size, (2, seq + 1), generator=gen)


def assert_logits_close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def check_round_trip(model, seed):
    config, params = hf.from_hf(model)
    t = tokens_for(model, seed)[:, :-1]
    with torch.no_grad():
        want = model(t).logits
        assert_logits_close(gpt.apply(params, t, config), want)
        back = hf.to_hf(params, config)
        assert type(back) is type(model)
        assert_logits_close(back(t).logits, want)


def check_gradients(model, seed, to_fmeg_names):
    """torch.func grads of fmeg's loss equal autograd grads of transformers' loss, mapped leaf by
    leaf."""
    config, params = hf.from_hf(model)
    t = tokens_for(model, seed)
    batch = {"tokens": t[:, :-1], "labels": t[:, 1:]}
    model.zero_grad()
    logits = model(batch["tokens"]).logits
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)
    ).backward()
    hf_grads = {k: p.grad for k, p in model.named_parameters()}
    if config.tie_embeddings:
        hf_grads["lm_head.weight"] = hf_grads[
            next(k for k in hf_grads if "wte" in k or "embed_tokens" in k)
        ]
    want = to_fmeg_names(hf_grads, config)
    got = tree.flatten(torch.func.grad(gpt.loss)(params, batch, config))
    assert set(got) == set(want)
    for path, g in got.items():
        torch.testing.assert_close(g, want[path], rtol=1e-4, atol=1e-6, msg=path)


@given(gpt2_models(), st.integers(0, 100))
def test_gpt2_logits_agree_both_ways(model, seed):
    check_round_trip(model, seed)


@given(llama_models(), st.integers(0, 100))
def test_llama_logits_agree_both_ways(model, seed):
    check_round_trip(model, seed)


@given(gpt2_models(), st.integers(0, 100))
def test_gpt2_gradients_agree(model, seed):
    check_gradients(model, seed, hf._gpt2_params)


@given(llama_models(), st.integers(0, 100))
def test_llama_gradients_agree(model, seed):
    check_gradients(model, seed, hf._llama_params)


def test_unsupported_models_and_configs_are_refused():
    with pytest.raises(ValueError, match="unsupported model"):
        hf.from_hf(torch.nn.Linear(2, 2))
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            intermediate_size=16,
            vocab_size=10,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        )
    )
    with pytest.raises(ValueError, match="rope_type"):
        hf.from_hf(llama)
    odd = gpt.GPTConfig(
        vocab_size=10, max_seq_len=8, num_layers=1, hidden_size=16, num_heads=2, norm="rmsnorm"
    )
    with pytest.raises(ValueError, match="to_hf"):
        hf.to_hf(gpt.init(odd, 0), odd)
