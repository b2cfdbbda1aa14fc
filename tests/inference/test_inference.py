"""Generation: the KV cache is exact, batching changes no row, sampling is a pure function of a key,
and the result matches transformers' generate and does not depend on the tp x pp layout."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.inference import SamplingParams, generate, new_cache, sample, stage_forward
from fmeg.inference.sampling import filtered_logits
from fmeg.models import gpt

GPT2_LIKE = gpt.GPTConfig.gpt2(
    vocab_size=97, max_seq_len=48, num_layers=2, hidden_size=32, num_heads=4, init_std=0.2
)
LLAMA_LIKE = gpt.GPTConfig.llama(
    vocab_size=101,
    max_seq_len=48,
    num_layers=2,
    hidden_size=48,
    num_heads=6,
    num_kv_heads=2,
    init_std=0.2,
    rotary_percent=0.5,
)

# DeepSeek-style multi-latent attention: its cache holds the expanded keys and values (not the
# latent)
MLA_LIKE = gpt.GPTConfig.llama(
    vocab_size=89,
    max_seq_len=48,
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=4,
    init_std=0.2,
    qk_norm=True,
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    mscale_all_dim=1.0,
    original_max_position_embeddings=8,
)


def _config(name: str) -> gpt.GPTConfig:
    return {"gpt2": GPT2_LIKE, "llama": LLAMA_LIKE, "mla": MLA_LIKE}[name]


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["gpt2", "llama", "mla"]),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_every_cached_step_equals_a_full_forward(name, lengths, chunks, seed):
    """Prefill rows of different lengths (left-padded together), then feed chunks of new tokens:
    every position's logits equal gpt.apply over that row's own unpadded prefix."""
    config = _config(name)
    params = gpt.init(config, seed)
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    longest = max(lengths)
    cache = new_cache(
        params,
        config,
        batch=len(rows),
        capacity=longest + sum(chunks),
        pad=torch.tensor([longest - n for n in lengths]),
    )
    tokens = torch.tensor([[0] * (longest - len(r)) + r for r in rows])
    logits, cache = stage_forward(params, tokens, None, cache, config)
    for r, row in enumerate(rows):
        full = gpt.apply(params, torch.tensor([row]), config)[0]
        torch.testing.assert_close(logits[r, longest - len(row) :], full, atol=1e-5, rtol=0)
    for size in chunks:
        new = torch.randint(0, config.vocab_size, (len(rows), size), generator=gen)
        logits, cache = stage_forward(params, new, None, cache, config)
        for r in range(len(rows)):
            rows[r] = rows[r] + new[r].tolist()
            full = gpt.apply(params, torch.tensor([rows[r]]), config)[0, -size:]
            torch.testing.assert_close(logits[r], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "sampling", [SamplingParams(temperature=0.0), SamplingParams(0.9, top_k=20, top_p=0.9)]
)
def test_a_batched_row_generates_what_it_generates_alone(name, sampling):
    config = _config(name)
    params = gpt.init(config, 1)
    prompts = [[5, 9, 2, 7, 1, 3], [4], [8, 8, 8]]
    seeds = [11, 12, 13]
    batched = generate(params, prompts, config, max_new_tokens=10, sampling=sampling, seed=seeds)
    for r, prompt in enumerate(prompts):
        alone = generate(
            params, [prompt], config, max_new_tokens=10, sampling=sampling, seed=seeds[r]
        )
        assert alone.tokens[0] == batched.tokens[r]
        torch.testing.assert_close(
            torch.tensor(alone.logprobs[0]), torch.tensor(batched.logprobs[r]), atol=1e-5, rtol=0
        )


def test_greedy_is_the_argmax_and_logprobs_are_the_models():
    config, prompt = LLAMA_LIKE, [3, 1, 4, 1, 5]
    params = gpt.init(config, 2)
    out = generate(
        params,
        [prompt],
        config,
        max_new_tokens=6,
        sampling=SamplingParams(temperature=0.0),
        return_prompt_logprobs=True,
    )
    seq = list(prompt)
    for token, logprob in zip(out.tokens[0], out.logprobs[0]):
        logp = torch.log_softmax(gpt.apply(params, torch.tensor([seq]), config)[0, -1], -1)
        assert token == int(logp.argmax())
        assert abs(logprob - float(logp[token])) < 1e-5
        seq.append(token)
    logp = torch.log_softmax(gpt.apply(params, torch.tensor([prompt]), config)[0, :-1], -1)
    expected = logp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[0]), expected, atol=1e-5, rtol=0)


def test_stops_at_end_of_document_and_at_a_stop_condition():
    config = GPT2_LIKE
    params = gpt.init(config, 3)
    greedy = SamplingParams(temperature=0.0)
    free = generate(params, [[1, 2, 3], [4, 5]], config, max_new_tokens=12, sampling=greedy)
    eod = free.tokens[0][4]
    cut = generate(params, [[1, 2, 3], [4, 5]], config, max_new_tokens=12, sampling=greedy, eod=eod)
    first = free.tokens[0].index(eod)
    assert cut.tokens[0] == free.tokens[0][: first + 1] and cut.finish_reasons[0] == "eod"
    stopped = generate(
        params,
        [[1, 2, 3]],
        config,
        max_new_tokens=12,
        sampling=greedy,
        stop=lambda row, ids: len(ids) == 3,
    )
    assert stopped.tokens[0] == free.tokens[0][:3] and stopped.finish_reasons == ["stop"]
    assert free.finish_reasons == ["length", "length"] and len(free.tokens[1]) == 12


def test_sampling_is_a_function_of_the_key_and_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    params = SamplingParams(temperature=1.0)
    draws = torch.stack([sample(logits, params, key) for key in range(4000)])[:, 0]
    assert torch.equal(
        draws, torch.stack([sample(logits, params, key) for key in range(4000)])[:, 0]
    )
    freq = torch.bincount(draws, minlength=5).float() / len(draws)
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.03, rtol=0)
    top2 = torch.stack([sample(logits, SamplingParams(1.0, top_k=2), key) for key in range(500)])
    assert set(top2.flatten().tolist()) == {0, 1}
    # p(0) = 0.64 < 0.7: keeps ids 0 and 1
    nucleus = filtered_logits(logits, SamplingParams(1.0, top_p=0.7))
    assert torch.isfinite(nucleus[0]).tolist() == [True, True, False, False, False]
    assert sample(logits, SamplingParams(temperature=0.0), 0).tolist() == [0]


def test_padded_vocabulary_ids_are_never_produced():
    config = GPT2_LIKE.replace(padded_vocab_size=128)
    params = gpt.init(config, 4)
    with torch.no_grad():  # padding rows that would win every argmax if they were ever a logit
        params["embedding"]["word"]["weight"][config.vocab_size :] = 50.0
    out = generate(
        params, [[1, 2]], config, max_new_tokens=20, sampling=SamplingParams(temperature=2.0)
    )
    assert max(out.tokens[0]) < config.vocab_size


@pytest.mark.parametrize(
    "bad, message",
    [
        ([[]], "empty"),
        ([[1, 200]], "outside the vocabulary"),
        ([[1] * 45], "exceeds the model's 48 positions"),
    ],
)
def test_bad_prompts_are_refused_with_a_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        generate(gpt.init(GPT2_LIKE, 0), bad, GPT2_LIKE, max_new_tokens=8)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_generation_equals_transformers_generate(name):
    transformers = pytest.importorskip("transformers")
    from fmeg.interop.hf import to_hf

    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = _config(name).replace(rotary_percent=1.0)  # Llama rotates whole heads
    params = gpt.init(config, 5)
    model = to_hf(params, config).eval()
    prompt = [7, 3, 3, 90, 12]
    ours = generate(
        params, [prompt], config, max_new_tokens=32, sampling=SamplingParams(temperature=0.0)
    )
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert isinstance(model, transformers.PreTrainedModel)
    assert ours.tokens[0] == theirs.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(theirs.logits, dim=1)[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ours.tokens[0])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours.logprobs[0]), expected, atol=1e-5, rtol=0)


LAYOUT_MODELS = {
    "gpt2": gpt.GPTConfig.gpt2(
        vocab_size=97,
        padded_vocab_size=128,
        max_seq_len=48,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        init_std=0.2,
    ),
    "llama": gpt.GPTConfig.llama(
        vocab_size=101,
        padded_vocab_size=128,
        max_seq_len=48,
        num_layers=2,
        hidden_size=64,
        num_heads=8,
        num_kv_heads=4,
        init_std=0.2,
    ),
    "mla": MLA_LIKE.replace(padded_vocab_size=128),
}


@pytest.mark.parametrize("name", ["gpt2", "llama", "mla"])
@pytest.mark.parametrize(
    "world, sizes",
    [(2, {"tp": 2}), (4, {"tp": 4}), (2, {"pp": 2}), (4, {"tp": 2, "pp": 2})],
    ids=["tp2", "tp4", "pp2", "tp2pp2"],
)
def test_every_layout_generates_what_one_rank_generates(name, world, sizes):
    """Greedy and seeded sampling, on gloo ranks: the same tokens on every rank as on one, logprobs
    to 1e-5."""
    from harness import spmd_programs as P
    from harness.parallel import gloo

    config = LAYOUT_MODELS[name]
    prompts, seeds = [[5, 9, 2, 7, 1, 3], [4], [8, 8, 8]], [1, 2, 3]
    for sampling in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=30, top_p=0.95),
    ):
        alone = generate(
            gpt.init(config, 6), prompts, config, max_new_tokens=12, sampling=sampling, seed=seeds
        )
        for tokens, logprobs in gloo(world).run(
            P.generation, config, 6, prompts, 12, sampling, seeds, **sizes
        ):
            assert tokens == alone.tokens
            torch.testing.assert_close(
                torch.tensor(logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0
            )
