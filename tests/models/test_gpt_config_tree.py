"""GPTConfig as a tree: the variants are groups that a dense model does not have, today's flat
keywords still make the same models, and the flat form checkpoints store (written before the tree
too) reads back to the same config."""

import json

import pytest

from fmeg.models.config_groups import MLA, MTP, Experts, RoPE, Router, YaRN
from fmeg.models.gpt import GPTConfig
from fmeg.models.gpt_config import FLAT_HINTS
from harness.paths import FIXTURES

SMALL = dict(vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4)
CONFIGS = {
    "gpt2": GPTConfig.gpt2(**SMALL),
    "llama": GPTConfig.llama(**SMALL, num_kv_heads=2, rope_scaling=(8.0, 1.0, 4.0, 64)),
    "moe": GPTConfig.llama(
        **SMALL, num_kv_heads=4, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01
    ),
    "mla_yarn_mtp": GPTConfig.llama(
        **{**SMALL, "num_layers": 3, "num_kv_heads": 4},
        multi_latent_attention=True,
        kv_lora_rank=8,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        mtp_num_layers=1,
        num_experts=4,
        moe_layer_freq=(0, 1, 1),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
    ),
}


def test_a_dense_gpt_has_none_of_the_variants():
    c = CONFIGS["gpt2"]
    assert (c.rope, c.experts, c.mtp, c.attention.mla) == (None, None, None, None)
    assert GPTConfig.llama(**SMALL, num_kv_heads=4).rope.kind == "rope"
    assert c.position == "learned" and c.mtp_depth == 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_flat_form_holds_every_stored_name_and_reads_back(name):
    c = CONFIGS[name]
    flat = c.flat()
    assert sorted(flat) == sorted(FLAT_HINTS)
    assert GPTConfig(**json.loads(json.dumps(flat))) == c


def test_flat_keywords_and_groups_make_the_same_model():
    by_flags = CONFIGS["mla_yarn_mtp"]
    by_groups = GPTConfig.llama(
        **{**SMALL, "num_layers": 3, "num_kv_heads": 4},
        attention=by_flags.attention.__class__(
            mla=MLA(kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8)
        ),
        rope=RoPE(kind="yarn", yarn=YaRN(factor=4.0)),
        mtp=MTP(num_layers=1),
        experts=Experts(
            num_experts=4,
            layer_freq=(0, 1, 1),
            router=Router(score_function="sigmoid", enable_expert_bias=True),
        ),
    )
    assert by_groups == by_flags


def test_replace_reaches_into_groups_by_flat_name_and_drops_a_group_by_its_switch():
    c = CONFIGS["moe"]
    assert c.replace(moe_router_topk=1).experts.router.topk == 1
    assert c.replace(num_experts=None).experts is None
    assert c.replace(position="learned").rope is None


@pytest.mark.parametrize(
    "flat, named",
    [
        (dict(moe_router_topk=1), "moe_router_topk: has no effect without num_experts"),
        (dict(rope_theta=5e5), "rope_theta: has no effect without position='rope'"),
        (dict(kv_lora_rank=16), "kv_lora_rank: has no effect without multi_latent_attention"),
        (dict(beta_fast=8.0), "beta_fast: has no effect without position='rope'"),
        (dict(mtp_loss_scaling_factor=0.3), "mtp_loss_scaling_factor: has no effect without"),
        (dict(rope_type="yarn"), "rope_type: has no effect without position='rope'"),
    ],
)
def test_a_setting_of_a_group_the_model_lacks_is_refused_by_name(flat, named):
    with pytest.raises(ValueError, match=f"GPTConfig.{named}"):
        GPTConfig(**SMALL, **flat)


@pytest.mark.parametrize("run", ["dense_tp2_pp2_bf16_zero", "mla_moe_mtp_ep2"])
def test_metadata_written_before_the_tree_reads_back_as_written(run):
    meta = json.loads(
        (FIXTURES / "before_redesign" / run / "iter_0000003" / "metadata.json").read_text()
    )
    stored = meta["model"]
    config = GPTConfig(**stored)
    as_json = json.loads(json.dumps(config.flat()))
    assert {k: v for k, v in as_json.items() if k in stored} == stored
