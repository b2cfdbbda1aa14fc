"""GPT-OSS imported from a tiny random transformers GptOssForCausalLM: the same logits (fp32, 1e-5)
with learnable sinks, alternating sliding windows, the clamped quick-GEGLU experts with biases and
YaRN; the same greedy tokens at tp 1 and tp 2 (recipes.convert_checkpoint, recipes.generate,
recipes.serve); export then import bitwise."""

import json

import pytest
import torch

from fmeg.interop.hf import from_hf, to_hf
from fmeg.models import gpt
from harness.runner import (
    assert_same_logits_and_round_trip,
    greedy_tokens_of_both,
    greedy_at_tp1_and_tp2,
)

transformers = pytest.importorskip("transformers")


def tiny_gpt_oss(seed: int = 0, window: int = 4):
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=0.8,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 1e4,
        },
    )
    model = transformers.GptOssForCausalLM(config)
    # move norms, sinks and biases from their init, so that a misplaced one shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                p.add_(0.3 * torch.randn_like(p))
            # routers with decided preferences: no near-ties in the top-k
            if name.endswith("router.weight"):
                p.mul_(20.0)
            # sharp logits: greedy tokens that do not repeat one id
            if "embed_tokens" in name or "lm_head" in name:
                p.mul_(30.0)
    return model.float().eval()


def test_imported_gpt_oss_logits_equal_transformers_and_export_round_trips():
    hf = tiny_gpt_oss()
    config, params = from_hf(hf)
    assert (
        config.attention.softmax_type,
        config.attention.window_size,
        config.attention.window_attn_skip_freq,
    ) == ("learnable", 3, (1, 0, 1))
    assert (config.activation, config.mlp.clamp, config.rope.yarn.round_to_int) == (
        "quick_geglu",
        0.8,
        False,
    )
    assert_same_logits_and_round_trip(hf, config, params, 97, 1)


def test_greedy_generation_of_an_imported_gpt_oss_gives_transformers_tokens():
    hf = tiny_gpt_oss(seed=3)
    config, params = from_hf(hf)
    prompt = [5, 17, 42, 8, 60, 3, 9]
    ours, theirs = greedy_tokens_of_both(hf, config, params, prompt)
    assert ours == theirs and len(set(theirs)) > 2


def test_gpt_oss_configs_transformers_cannot_hold_are_refused_in_one_line():
    config = gpt.GPTConfig.llama(
        vocab_size=50,
        max_seq_len=16,
        num_layers=2,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=2,
        activation="quick_geglu",
        num_experts=4,
        bias=True,
    )
    with pytest.raises(ValueError, match="GptOssForCausalLM needs .*learnable sinks"):
        to_hf(gpt.init(config, 0), config)


# the GPT-OSS pieces at tp 2 are checked against one device in tests/parallel/test_parallel_gpt.py
@pytest.mark.slow
def test_an_imported_gpt_oss_generates_transformers_tokens_at_tp1_and_tp2(tmp_path):
    hf = tiny_gpt_oss(seed=5)
    hf.save_pretrained(tmp_path / "gpt_oss")
    rows = greedy_at_tp1_and_tp2(tmp_path / "gpt_oss", tmp_path, "5 17 42 8 60 3", 8, 97)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([[5, 17, 42, 8, 60, 3]]), max_new_tokens=8, do_sample=False
        )[0, 6:].tolist()
    assert rows[0] == rows[1] == theirs and len(set(theirs)) > 2
    # recipes.serve answers an OpenAI completion with the same tokens
    from harness.runner import Server

    server = Server(
        str(tmp_path / "ckpt"), extra=["--tokenizer-type", "NullTokenizer", "--vocab-size", "97"]
    )
    try:
        status, body = server.request(
            "POST",
            "/v1/completions",
            {"prompt": "5 17 42 8 60 3", "max_tokens": 8, "temperature": 0.0},
        )
    finally:
        server.stop()
    assert status == 200 and json.loads(body)["choices"][0]["text"] == " ".join(map(str, theirs))


def test_an_imported_gpt_oss_comes_back_from_its_checkpoint_args():
    """--use-checkpoint-args on an imported GPT-OSS gives its own YaRN (original context, rounding),
    not --enable-gpt-oss's defaults, and its experts."""

    from fmeg.config.arguments import parse_args
    from fmeg.config.checkpoint_args import model_flags
    from fmeg.config.run_config import model_config

    config, _ = from_hf(tiny_gpt_oss())
    a = parse_args(
        [
            "--num-layers",
            "1",
            "--hidden-size",
            "8",
            "--num-attention-heads",
            "1",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
        ],
        world_size=1,
    )
    for name, value in model_flags(config.flat()).items():
        setattr(a, name, value)
    assert model_config(a, config.vocab_size).replace(padded_vocab_size=config.vocab_size) == config
