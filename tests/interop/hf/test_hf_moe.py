"""Mixtral and Qwen3-MoE imported from tiny random transformers models: the same logits (fp32,
1e-5), the same greedy tokens, and export then import bitwise, for both of Qwen3-MoE's routings
(norm_topk_prob) and a dense first layer (mlp_only_layers)."""

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


def tiny_moe(family: str, seed: int = 0, norm_topk_prob: bool = True):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **common, intermediate_size=24, num_local_experts=4, router_jitter_noise=0.0
            )
        )
    else:
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **common,
                head_dim=16,
                intermediate_size=40,
                moe_intermediate_size=12,
                num_experts=4,
                norm_topk_prob=norm_topk_prob,
                mlp_only_layers=[0],
                use_sliding_window=False,
            )
        )
    with torch.no_grad():  # transformers starts norms at 1: move them so the test sees them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            # routers with decided preferences: no near-ties in the top-k
            if name.endswith("gate.weight"):
                p.mul_(20.0)
    return model.float().eval()


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize(
    "family, norm_topk_prob", CASES, ids=["mixtral", "qwen3_moe", "qwen3_moe_pre_softmax"]
)
def test_imported_moe_logits_equal_transformers_and_export_round_trips(family, norm_topk_prob):
    hf = tiny_moe(family, norm_topk_prob=norm_topk_prob)
    config, params = from_hf(hf)
    assert config.experts.num_experts == 4 and config.experts.router.topk == 2
    assert gpt.moe.moe_layers(config) == (
        (True,) * 3 if family == "mixtral" else (False, True, True)
    )
    assert config.experts.router.pre_softmax == (not norm_topk_prob)
    assert_same_logits_and_round_trip(hf, config, params, 97, 1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_greedy_generation_of_an_imported_moe_gives_transformers_tokens(family):
    hf = tiny_moe(family, seed=3)
    config, params = from_hf(hf)
    prompt = [5, 17, 42, 8, 60]
    ours, theirs = greedy_tokens_of_both(hf, config, params, prompt)
    assert ours == theirs


def test_moe_configs_transformers_cannot_hold_are_refused_in_one_line():
    config = gpt.GPTConfig.llama(
        vocab_size=50,
        max_seq_len=16,
        num_layers=2,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=2,
        num_experts=4,
        moe_router_score_function="sigmoid",
    )
    with pytest.raises(ValueError, match="softmax routers"):
        to_hf(gpt.init(config, 0), config)


# the layer at tp 2 without sp is checked against one device in tests/models/test_moe.py
@pytest.mark.slow
def test_an_imported_mixtral_generates_the_same_tokens_at_tp2_as_on_one_rank(tmp_path):
    """recipes.convert_checkpoint import-hf on a Mixtral directory, then recipes.generate greedy at
    tp 1 and at tp 2 (every rank routing all tokens, the experts' F split): the same tokens, and
    transformers' tokens."""
    hf = tiny_moe("mixtral", seed=5)
    hf.save_pretrained(tmp_path / "mixtral")
    rows = greedy_at_tp1_and_tp2(tmp_path / "mixtral", tmp_path, "5 17 42", 8, 97)
    assert rows[0] == rows[1] and len(rows[0]) == 8
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=8, do_sample=False)[
            0, 3:
        ].tolist()
    assert rows[0] == theirs
