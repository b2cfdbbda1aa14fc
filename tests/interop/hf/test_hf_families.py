"""The open models people continue from: Llama 3.1 (llama3 rope scaling), Llama 3.2 (tied
embeddings), Qwen2.5 (a bias on q, k and v) and Qwen3 (a norm on each head's queries and keys),
imported from tiny random transformers models: the same logits (fp32), the same greedy tokens, and
export then import bitwise; and the new options sharded over tensor parallelism equal one rank."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg import tree
from fmeg.interop.hf import from_hf
from fmeg.models import gpt
from harness.runner import assert_same_logits_and_round_trip, greedy_tokens_of_both
from harness.data_files import hf_tokenizer_dir

transformers = pytest.importorskip("transformers")

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny(family: str, heads: int, groups: int, head_dim: int, layers: int, seed: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=heads * head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        intermediate_size=48,
        max_position_embeddings=64,
        head_dim=head_dim,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama3.1":
        config = transformers.LlamaConfig(**common, rope_parameters=LLAMA31_ROPE)
    elif family == "llama3.2":
        config = transformers.LlamaConfig(
            **common, tie_word_embeddings=True, rope_parameters={**LLAMA31_ROPE, "factor": 32.0}
        )
    elif family == "qwen2.5":
        config = transformers.Qwen2Config(
            **common,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True,
        )
    else:
        config = transformers.Qwen3Config(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    model = getattr(
        transformers,
        {
            "llama3.1": "LlamaForCausalLM",
            "llama3.2": "LlamaForCausalLM",
            "qwen2.5": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[family],
    )(config)
    # transformers starts norms at 1 and biases at 0: move them so the test sees them
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.float().eval()


FAMILIES = ["llama3.1", "llama3.2", "qwen2.5", "qwen3"]


@settings(max_examples=4, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    groups=st.sampled_from([1, 2]),
    per_group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 16]),
    layers=st.integers(1, 2),
    seed=st.integers(0, 100),
)
def test_imported_logits_equal_transformers_and_export_round_trips(
    family, groups, per_group, head_dim, layers, seed
):
    hf = tiny(family, groups * per_group, groups, head_dim, layers, seed)
    config, params = from_hf(hf)
    assert (
        config.attention.qk_norm,
        config.attention.qkv_bias,
        config.rope.scaling is not None,
        config.tie_embeddings,
    ) == (
        family == "qwen3",
        family == "qwen2.5",
        family.startswith("llama"),
        family in ("llama3.2", "qwen2.5"),
    )
    assert_same_logits_and_round_trip(hf, config, params, 97, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_gives_transformers_tokens(family):
    hf = tiny(family, 4, 2, 16, 2, 3)
    config, params = from_hf(hf)
    prompt = [5, 17, 42, 8, 60]
    ours, theirs = greedy_tokens_of_both(hf, config, params, prompt)
    assert ours == theirs


def test_llama3_rope_scaling_is_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fmeg.ops.rope import llama3_scaled

    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=32768,
        rope_parameters={**LLAMA31_ROPE, "original_max_position_embeddings": 8192},
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    torch.testing.assert_close(llama3_scaled(base, 8.0, 1.0, 4.0, 8192), want)


@pytest.mark.parametrize(
    "options",
    [
        dict(qk_norm=True),
        dict(qkv_bias=True, bias=False),
        dict(rope_scaling=(8.0, 1.0, 4.0, 16)),
        dict(activation="squared_relu"),
    ],
)
def test_the_new_options_sharded_over_tp_equal_one_rank(options):
    """Forward and gradients at tp 2 (sequence parallel too) equal one rank's slices; the q/k norm
    weight is replicated and its gradient sums every rank's heads."""
    from fmeg.parallel.sharding import shard, unshard
    from fmeg.parallel.spmd import run_threads
    from fmeg.parallel.tensor import TensorParallel

    base = dict(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
    )
    config = gpt.GPTConfig(**{**base, **options})
    params = gpt.init(config, 0)
    if config.attention.qk_norm:  # away from the init's ones, so that a wrong gradient shows
        params = tree.tree_map(lambda t: t, params)
        for layer in params["layers"]:
            layer["attn"]["q_norm"]["weight"] = 1.0 + 0.3 * torch.randn(config.head_dim)
    if config.attention.qkv_bias:
        for layer in params["layers"]:
            layer["attn"]["qkv"]["bias"] = 0.1 * torch.randn_like(layer["attn"]["qkv"]["bias"])
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    want_loss, want_grads = torch.func.grad_and_value(gpt.loss)(params, batch, config)[::-1]
    for sp in (False, True):

        def program(mesh):
            tp = TensorParallel(mesh.group("tp"), sp)
            local = shard(params, gpt.TP_RULES, {"tp": (mesh.coord("tp"), 2)})
            grads, loss = torch.func.grad_and_value(lambda p: gpt.loss(p, batch, config, tp=tp))(
                local
            )
            return loss, grads

        outs = run_threads(2, program, tp=2)
        torch.testing.assert_close(outs[0][0], want_loss, rtol=1e-5, atol=1e-6)
        grads = unshard([g for _, g in outs], gpt.TP_RULES, "tp")
        for (path, got), (_, want) in zip(tree.items(grads), tree.items(want_grads)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=path)


@pytest.mark.parametrize(
    "options",
    [
        dict(qk_norm=True),
        dict(qkv_bias=True),
        dict(rope_scaling=(8.0, 1.0, 4.0, 8192)),
        dict(qk_norm=True, qkv_bias=True, rope_scaling=(32.0, 1.0, 4.0, 8192)),
    ],
)
def test_the_options_equal_megatron_cores_gpt_model(options):
    """fmeg's GPT with q/k norm, q/k/v bias and RoPE scaling equals megatron-core's GPTModel (local
    spec, qk_layernorm, add_qkv_bias, rope_scaling) holding the same weights, on CPU."""
    pytest.importorskip("megatron.core.models.gpt")
    from harness import spmd_programs as P
    from harness.parallel import gloo

    config = gpt.GPTConfig(
        vocab_size=128,
        max_seq_len=32,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        norm="rmsnorm",
        activation="swiglu",
        position="rope",
        bias=False,
        tie_embeddings=False,
        rope_theta=500000.0,
        **options,
    )
    params = gpt.init(config, 0)
    # norms and biases away from their init, so that a misplaced one shows
    for layer in params["layers"]:
        for leaf in ("q_norm", "k_norm"):
            if leaf in layer["attn"]:
                layer["attn"][leaf]["weight"] = 1.0 + 0.3 * torch.randn(config.head_dim)
        if config.attention.qkv_bias:
            layer["attn"]["qkv"]["bias"] = 0.1 * torch.randn_like(layer["attn"]["qkv"]["bias"])
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = gloo(1).run(P.megatron_gpt_logits, params, tokens, config, tp=1)[0]  # its own process
    ours = gpt.apply(params, tokens, config)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES + ["gpt2"])
def test_use_checkpoint_args_reads_back_the_models_flags(tmp_path, family):
    """Megatron's --use-checkpoint-args: the flags it sets from a checkpoint's model give that model
    again."""
    from fmeg.config.arguments import parse_args
    from fmeg.config.run_config import model_config
    from harness.checkpoints import save_one

    if family == "gpt2":
        config = gpt.GPTConfig.gpt2(
            vocab_size=97, max_seq_len=32, num_layers=2, hidden_size=32, num_heads=4
        )
    else:
        config, _ = from_hf(tiny(family, 4, 2, 16, 2, 0))
    save_one(tmp_path / "ck", 1, config)
    a = parse_args(["--load", str(tmp_path / "ck"), "--use-checkpoint-args", "--seq-length", "16"])
    got = model_config(a, config.vocab_size)
    assert got.replace(padded_vocab_size=None, hidden_dropout=0.0, attention_dropout=0.0) == config


QWEN3_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "16",
    "--ffn-hidden-size",
    "48",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--swiglu",
    "--disable-bias-linear",
    "--qk-layernorm",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "1000000",
    "--untie-embeddings-and-output-weights",
    "--max-position-embeddings",
    "64",
    "--seq-length",
    "32",
]


@pytest.mark.slow
def test_an_imported_qwen3_continues_pretraining_and_is_served(tmp_path):
    """transformers' Qwen3 -> convert_checkpoint import-hf -> the runner continues pretraining it
    with --load --finetune on the embedded data (dropout changed on load, with a warning) ->
    recipes.generate serves the result, and export-hf gives transformers a model with the trained
    weights."""
    from harness.runner import run_group, run_recipe
    import sys

    hf = tiny("qwen3", 4, 2, 16, 2, 0)
    hf.config.vocab_size = 257  # the byte tokenizer of the embedded data
    hf.resize_token_embeddings(257)
    hf.save_pretrained(tmp_path / "qwen3")
    convert = [sys.executable, "-m", "recipes.convert_checkpoint"]
    out = run_group(
        [
            *convert,
            "import-hf",
            "--input",
            str(tmp_path / "qwen3"),
            "--save",
            str(tmp_path / "imported"),
        ]
    )
    assert out.returncode == 0, out.stderr
    records, stdout = run_recipe(
        tmp_path,
        "continued",
        2,
        [
            "--use-checkpoint-args",
            "--seq-length",
            "32",
            "--load",
            str(tmp_path / "imported"),
            "--finetune",
            "--save",
            str(tmp_path / "ck"),
            "--tensor-model-parallel-size",
            "2",
            "--train-iters",
            "6",
            "--lr",
            "1e-3",
            "--lr-warmup-iters",
            "1",
            "--hidden-dropout",
            "0.1",
        ],
    )
    assert "fine-tuning from" in stdout and "warning: --load" in stdout and len(records) == 6
    out = run_group(
        [
            sys.executable,
            "-m",
            "recipes.generate",
            "--load",
            str(tmp_path / "ck"),
            "--prompt",
            "def ",
            "--tokens",
            "8",
            "--temperature",
            "0",
            "--json",
        ]
    )
    assert out.returncode == 0 and len(json.loads(out.stdout)["tokens"]) == 8, out.stderr
    out = run_group(
        [*convert, "export-hf", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]
    )
    assert out.returncode == 0, out.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert type(back).__name__ == "Qwen3ForCausalLM" and back.config.vocab_size == 257


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_llama3_and_qwen_tokenizers_round_trip_through_preprocess_runner_and_generation(
    tmp_path, style
):
    """Ids as transformers' AutoTokenizer gives them (Llama 3's BOS in front, Qwen's none), its eos
    as the end of document; preprocess_data, the runner and recipes.generate all read the
    directory."""
    from fmeg.data.tokenizers import build_tokenizer
    from recipes import preprocess_data
    from harness.runner import run_group, run_recipe
    import sys

    directory = hf_tokenizer_dir(tmp_path, style)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    ours = build_tokenizer("HuggingFaceTokenizer", model=directory)
    for text in ("def f7(x):\n    return x", "the quick brown fox", "naïve <|im_start|> x"):
        assert ours.encode(text) == theirs(text).input_ids
        assert ours.decode(ours.encode(text)[1 if style == "llama3" else 0 :]) == text
    assert ours.eod == theirs.eos_token_id and ours.vocab_size == len(theirs)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}"}) for i in range(200))
    )
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory]
    assert (
        preprocess_data.main(
            [
                "--input",
                str(corpus),
                "--output-prefix",
                str(tmp_path / "data"),
                "--append-eod",
                *tokenizer,
            ]
        )
        == 0
    )
    from fmeg.data.indexed import IndexedDataset

    first = IndexedDataset(str(tmp_path / "data_text_document"))[0].tolist()
    assert first == theirs("def f0(x):\n    return x * 0").input_ids + [theirs.eos_token_id]
    records, _ = run_recipe(
        tmp_path,
        "trained",
        1,
        [
            *tokenizer,
            "--data-path",
            str(tmp_path / "data_text_document"),
            "--save",
            str(tmp_path / "ck"),
            "--train-iters",
            "4",
            "--lr-warmup-iters",
            "1",
            "--seq-length",
            "16",
        ],
    )
    assert len(records) == 4
    out = run_group(
        [
            sys.executable,
            "-m",
            "recipes.generate",
            "--load",
            str(tmp_path / "ck"),
            "--prompt",
            "def f",
            "--tokens",
            "4",
            "--json",
        ]
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert row["prompt"] == "def f" and len(row["tokens"]) >= 1
