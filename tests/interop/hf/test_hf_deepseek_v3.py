"""DeepSeek-V3 imported from a tiny random transformers DeepseekV3ForCausalLM: multi-latent
attention (with and without q-lora) with YaRN, dense then DeepSeek-MoE layers (sigmoid router,
expert bias, groups, routed scaling, shared experts) give transformers' logits (fp32, 1e-5) and
greedy tokens, at tp 1 and tp 2 through recipes.convert_checkpoint and recipes.generate; the
multi-token prediction depths stored after the last decoder layer (as DeepSeek-V3's and Kimi-K2's
checkpoints store them) import into fmeg's MTP, whose depth losses equal transformers' own MtpLayer
on the same weights, and export back to the same tensors."""

import pytest
import torch
from safetensors import safe_open

from fmeg import tree
from fmeg.interop.hf import from_hf, mtp_files, read_dir, to_hf
from fmeg.models import gpt, mtp
from recipes import convert_checkpoint
from harness.runner import (
    assert_same_logits_and_round_trip,
    greedy_tokens_of_both,
    greedy_at_tp1_and_tp2,
)

transformers = pytest.importorskip("transformers")
VOCAB, LAYERS = 97, 3


def tiny_config(q_lora_rank=24, mtp_depths=0):
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=12,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        num_mtp_layers=mtp_depths,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 1e4,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    )


def perturbed(module, sharp: bool = False):
    """Norms and expert biases moved from their init (a misplaced one shows), routers with decided
    preferences (no near-ties in the top-k), and with sharp, logits whose greedy tokens do not
    repeat one id."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            if name.endswith("gate.weight"):
                p.mul_(20.0)
            if sharp and ("embed_tokens" in name or "lm_head" in name):
                p.mul_(30.0)
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    return module.float().eval()


def tiny_deepseek_v3(seed: int = 0, q_lora_rank=24, mtp_depths=0, sharp=False):
    torch.manual_seed(seed)
    return perturbed(
        transformers.DeepseekV3ForCausalLM(tiny_config(q_lora_rank, mtp_depths)), sharp
    )


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_imported_deepseek_v3_logits_equal_transformers_and_export_round_trips(q_lora_rank):
    hf = tiny_deepseek_v3(q_lora_rank=q_lora_rank)
    config, params = from_hf(hf)
    assert (
        config.attention.mla is not None,
        config.attention.mla.q_lora_rank,
        config.experts.layer_freq,
    ) == (True, q_lora_rank, (0, 1, 1))
    assert (
        config.experts.router.num_groups,
        config.experts.router.group_topk,
        config.experts.router.topk_scaling_factor,
        config.experts.shared_expert_intermediate_size,
        config.rope.kind,
    ) == (4, 2, 2.5, 16, "yarn")
    assert tree.flatten(params).keys() == tree.flatten(gpt.init(config, 0)).keys()
    assert_same_logits_and_round_trip(hf, config, params, VOCAB, 1)


def test_greedy_generation_of_an_imported_deepseek_v3_gives_transformers_tokens():
    hf = tiny_deepseek_v3(seed=3, sharp=True)
    config, params = from_hf(hf)
    prompt = [5, 17, 42, 8, 60, 3, 9]
    ours, theirs = greedy_tokens_of_both(hf, config, params, prompt)
    assert ours == theirs and len(set(theirs)) > 2


def mtp_layers(hf, depths: int):
    """transformers' MtpLayer for each depth: a DeepseekV3DecoderLayer numbered after the decoder
    (an MoE layer, as DeepSeek-V3's), random, perturbed as the model is."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    layers = [
        MtpLayer(hf.config, ds.DeepseekV3DecoderLayer, ds.DeepseekV3RMSNorm, LAYERS + k)
        for k in range(depths)
    ]
    # drawn as transformers' _init_weights draws a model's (MtpLayer alone leaves them empty)
    with torch.no_grad():
        for name, p in (named for layer in layers for named in layer.named_parameters()):
            p.copy_(torch.ones_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    return [perturbed(layer) for layer in layers]


def deepseek_layout(layer, hf, k: int) -> dict[str, torch.Tensor]:
    """An MtpLayer's weights named and laid out as DeepSeek-V3's checkpoints hold depth k:
    model.layers.{L + k}.*, one tensor per expert, with copies of the embedding and the output
    layer."""
    at, out = f"model.layers.{LAYERS + k}", {}
    for name, t in layer.state_dict().items():
        name = name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{at}.mlp.experts.{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{at}.mlp.experts.{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{at}.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[f"{at}.{name}"] = t.clone()
    out[f"{at}.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    out[f"{at}.shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    return out


def transformers_depth_losses(hf, layers, tokens, labels) -> list[float]:
    """Each depth's mean loss by transformers' modules: depth k embeds the tokens k places on,
    combines them with the previous depth's states through its MtpLayer, and predicts the labels k
    places on (the last k places of each row count nothing)."""
    s = tokens.shape[1]
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    positions = torch.arange(s)[None]
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state
        rope = hf.model.rotary_emb(hidden, positions)
        losses = []
        for k, layer in enumerate(layers, start=1):
            ids = torch.nn.functional.pad(tokens[:, k:], (0, k))
            hidden = layer(hf.model.embed_tokens(ids), hidden, rope, mask, positions, None)
            logits = hf.lm_head(hidden)[:, : s - k]
            losses.append(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCAB), labels[:, k:].reshape(-1)
                ).item()
            )
    return losses


def test_mtp_depths_import_equal_transformers_mtp_layers_and_export_to_the_same_files(tmp_path):
    from fmeg.interop.hf_dir import add_weight_file

    hf = tiny_deepseek_v3(seed=2, mtp_depths=2)
    layers = mtp_layers(hf, 2)
    hf.save_pretrained(tmp_path / "ds")
    files = {}
    for k, layer in enumerate(layers):
        files |= deepseek_layout(layer, hf, k)
    add_weight_file(tmp_path / "ds", "model-mtp.safetensors", files)

    assert (
        convert_checkpoint.main(
            ["import-hf", "--input", str(tmp_path / "ds"), "--save", str(tmp_path / "ckpt")]
        )
        == 0
    )
    config, params = convert_checkpoint.load_full(str(tmp_path / "ckpt"))
    assert config.mtp_depth == 2 and len(params["mtp"]) == 2
    tokens = torch.randint(0, VOCAB, (2, 25), generator=torch.Generator().manual_seed(4))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    want = transformers_depth_losses(hf, layers, batch["tokens"], batch["labels"])
    assert mtp.values(params, batch, config) == pytest.approx(want, rel=1e-5)

    assert (
        convert_checkpoint.main(
            ["export-hf", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]
        )
        == 0
    )
    with safe_open(str(tmp_path / "out" / "model-mtp.safetensors"), framework="pt") as f:
        exported = {name: f.get_tensor(name) for name in f.keys()}
    assert exported.keys() == files.keys()
    assert all(torch.equal(exported[name], files[name]) for name in files)
    config2, params2 = read_dir(str(tmp_path / "out"))
    assert config2 == config.replace(padded_vocab_size=VOCAB)
    flat, flat2 = tree.flatten(params), tree.flatten(params2)
    # the depths' copy
    assert torch.equal(flat.pop("mtp_embedding.weight"), flat["embedding.word.weight"])
    assert flat.keys() == flat2.keys() and all(torch.equal(flat[k], flat2[k]) for k in flat)
    assert mtp_files(params2, config2).keys() == files.keys()


def test_deepseek_v3_directories_fmeg_cannot_hold_are_refused_in_one_line(tmp_path):
    from fmeg.interop.hf_dir import add_weight_file

    hf = tiny_deepseek_v3(mtp_depths=2)
    hf.save_pretrained(tmp_path / "ds")
    add_weight_file(
        tmp_path / "ds", "model-mtp.safetensors", deepseek_layout(mtp_layers(hf, 1)[0], hf, 0)
    )
    with pytest.raises(ValueError, match="the files hold 1 of the 2 MTP depths"):
        read_dir(str(tmp_path / "ds"))
    lone = tiny_config()
    lone.n_group, lone.topk_group = 8, 4
    with pytest.raises(ValueError, match="n_group 8 with 1 experts a group"):
        config_from_hf(lone)
    config = gpt.GPTConfig.llama(
        vocab_size=50,
        max_seq_len=16,
        num_layers=2,
        hidden_size=16,
        num_heads=4,
        num_kv_heads=4,
        multi_latent_attention=True,
        kv_lora_rank=8,
        qk_head_dim=4,
        qk_pos_emb_head_dim=4,
        v_head_dim=4,
    )
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM needs latent norms"):
        to_hf(gpt.init(config, 0), config)


def config_from_hf(hf_config):
    from fmeg.interop.hf_deepseek_v3 import config_from

    return config_from(hf_config)


@pytest.mark.parametrize(
    "fields, message",
    [
        # transformers' router would divide by it; it imported as ungrouped, topk_group dropped
        (dict(n_group=0), "n_group 0 with topk_group 2, which would be dropped: give n_group >= 1"),
        (dict(n_group=-1, topk_group=None), "n_group -1: give n_group >= 1"),
        (dict(n_group=3), "n_group 3 must divide n_routed_experts 8"),
        (dict(topk_group=5), "topk_group 5 must be in [1, n_group 4]"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok 9 must be in [1, n_routed_experts 8]"),
        (
            dict(n_group=2, topk_group=1, num_experts_per_tok=6),
            "num_experts_per_tok 6 exceeds the 4 experts of topk_group 1 groups of 4",
        ),
        # GPTConfig's own checks, in config.json's names
        (dict(moe_intermediate_size=0), "moe_intermediate_size: must be positive, got 0"),
    ],
)
def test_contradicting_config_json_fields_are_refused_in_its_own_names(fields, message):
    hf_config = tiny_config()
    for name, value in fields.items():
        setattr(hf_config, name, value)
    with pytest.raises(ValueError) as e:
        config_from_hf(hf_config)
    line = str(e.value)
    assert line.startswith("from_hf: DeepSeek-V3 config.json: ") and message in line, line
    assert "GPTConfig" not in line and "moe_router" not in line, line


# transformers' routing: a group ranked by its best two scores, top-k weights normalised by
# norm_topk_prob
ROUTING_RULES = {
    "groups taking one expert each": dict(num_experts_per_tok=2, n_group=4, topk_group=2),
    "three experts from two groups": dict(num_experts_per_tok=3, n_group=4, topk_group=2),
    "top-k weights unnormalised": dict(norm_topk_prob=False),
    "one group": dict(n_group=1, topk_group=1),
}


@pytest.mark.parametrize("rule", ROUTING_RULES)
def test_transformers_routing_rules_import_as_transformers_computes_them(rule):
    """Any valid DeepseekV3Config imports and computes what transformers does: its logits (1e-5),
    its export round trip, its greedy tokens; where megatron-core's rule differs (groups ranked by
    their top-k / topk_group, top-k always normalised), that rule gives other logits, and export to
    Megatron is refused in one line."""
    from fmeg.interop.megatron.model_args import args_for

    hf_config = tiny_config()
    for name, value in ROUTING_RULES[rule].items():
        setattr(hf_config, name, value)
    torch.manual_seed(4)
    hf = perturbed(transformers.DeepseekV3ForCausalLM(hf_config), sharp=True)
    config, params = from_hf(hf)
    assert_same_logits_and_round_trip(hf, config, params, VOCAB, 1)
    ours, theirs = greedy_tokens_of_both(hf, config, params, [5, 17, 42, 8, 60, 3, 9])
    assert ours == theirs
    if rule == "one group":  # no group to rank, and top-k normalised: the rules agree
        assert config.experts.router.group_score_topk is None and config.experts.router.norm_topk
        return
    # 3 / 2 experts a group: megatron-core has no such rule
    if rule != "three experts from two groups":
        megatrons = config.replace(moe_router_group_score_topk=None, moe_router_norm_topk=True)
        tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
        assert not torch.allclose(
            gpt.apply(params, tokens, megatrons), gpt.apply(params, tokens, config)
        )
    with pytest.raises(ValueError, match="which megatron-core's router does not compute"):
        args_for(config)


# MLA and experts at tp 2 are checked against one device in tests/parallel/test_parallel_gpt.py
@pytest.mark.slow
def test_an_imported_deepseek_v3_generates_transformers_tokens_at_tp1_and_tp2(tmp_path):
    hf = tiny_deepseek_v3(seed=5, sharp=True)
    hf.save_pretrained(tmp_path / "ds")
    rows = greedy_at_tp1_and_tp2(tmp_path / "ds", tmp_path, "5 17 42 8 60 3", 8, VOCAB)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([[5, 17, 42, 8, 60, 3]]), max_new_tokens=8, do_sample=False
        )[0, 6:].tolist()
    assert rows[0] == rows[1] == theirs and len(set(theirs)) > 2


def test_an_imported_deepseek_v3_comes_back_from_its_checkpoint_args():
    """--use-checkpoint-args on an imported DeepSeek-V3 gives its attention, experts, router
    (transformers' routing rules too) and MTP depths."""

    from fmeg.config.arguments import parse_args
    from fmeg.config.checkpoint_args import model_flags
    from fmeg.config.run_config import model_config

    default = from_hf(tiny_deepseek_v3())[0].replace(mtp_num_layers=2)
    # transformers' rules
    for config in (default, default.replace(moe_router_topk=2, moe_router_norm_topk=False)):
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
        assert (
            model_config(a, config.vocab_size).replace(padded_vocab_size=config.vocab_size)
            == config
        )


def test_a_kimi_k2_directory_imports_as_deepseek_v3_and_an_fp8_one_is_refused_in_one_line(tmp_path):
    """Kimi-K2's config.json names model_type kimi_k2 (with its own modelling code, which fmeg never
    runs) and the legacy rope_scaling: it imports as the DeepseekV3ForCausalLM it is. The released
    FP8 weights (a quantization_config) are one line saying to convert them first."""
    import json

    hf = tiny_deepseek_v3(seed=6)
    hf.save_pretrained(tmp_path / "kimi")
    fields = json.loads((tmp_path / "kimi" / "config.json").read_text())
    rope = fields.pop("rope_parameters")
    fields |= {
        "model_type": "kimi_k2",
        "rope_theta": rope.pop("rope_theta"),
        "rope_scaling": {**rope, "type": rope.pop("rope_type")},
        "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    }
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(fields))
    config, params = read_dir(str(tmp_path / "kimi"))
    assert config == from_hf(hf)[0]
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            gpt.apply(params, tokens, config), hf(tokens).logits, rtol=1e-5, atol=1e-5
        )
    fields["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(fields))
    assert (
        convert_checkpoint.main(
            ["import-hf", "--input", str(tmp_path / "kimi"), "--save", str(tmp_path / "ckpt")]
        )
        == 2
    )
    assert not (tmp_path / "ckpt").exists()
