"""Megatron's flags mean what they mean in Megatron: its defaults, its derived sizes, the places
where it adjusts a flag and goes on (fmeg warns in one line and goes on too), and its runtime flags,
which are accepted and named as ignored where they cannot change a number."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg import tree
from fmeg.models import gpt, self_attention
from fmeg.config.arguments import lr_steps, parse_args
from fmeg.config.validation import validate
from fmeg.config.megatron_flags import ignored_flags
from harness.runner import run_recipe, sentencepiece_model, tiktoken_vocabulary

# Megatron-LM's defaults (megatron/training/arguments.py) for the flags fmeg shares, where Megatron
# has one.
MEGATRON_DEFAULTS = {
    "lr_decay_style": "linear",
    "min_lr": 0.0,
    "lr_warmup_iters": 0,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "weight_decay": 0.01,
    "clip_grad": 1.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "seed": 1234,
    "init_method_std": 0.02,
    "norm_epsilon": 1e-5,
    "rotary_base": 10000,
    "make_vocab_size_divisible_by": 128,
    "split": "969,30,1",
    "initial_loss_scale": 2.0**32,
    "min_loss_scale": 1.0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "distributed_timeout_minutes": 10,
    "position_embedding_type": "learned_absolute",
    "normalization": "LayerNorm",
    "check_for_nan_in_loss_and_grad": True,
    "loss_scale": None,
    "exit_signal": "SIGTERM",
    "wandb_project": "",
    "wandb_exp_name": "",
    "wandb_save_dir": "",
    "wandb_entity": "",
    "logging_level": None,
    "step_batch_size_schedule": None,
}
# Where fmeg's default differs (Megatron: log interval 100, eval iters 100) or Megatron has none
# (the flag is required there): the table of differences in docs/megatron.md.
FMEG_ONLY = {
    "lr": 3e-3,
    "train_iters": 100,
    "micro_batch_size": 4,
    "num_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "seq_length": 128,
    "log_interval": 10,
    "eval_iters": 2,
}


def test_defaults_are_megatrons():
    a = parse_args([])
    got = {k: getattr(a, k) for k in MEGATRON_DEFAULTS}
    assert got == MEGATRON_DEFAULTS
    assert {k: getattr(a, k) for k in FMEG_ONLY} == FMEG_ONLY


@given(st.integers(24, 20000))
def test_swiglu_ffn_size_is_megatrons_rounded_down(hidden):
    # Megatron's derivation when --ffn-hidden-size is absent
    megatron = int((4 * hidden * 2 / 3) / 64) * 64
    config = gpt.GPTConfig(
        vocab_size=8,
        max_seq_len=8,
        num_layers=1,
        hidden_size=hidden,
        num_heads=1,
        activation="swiglu",
    )
    assert config.ffn_hidden_size == megatron
    assert (
        gpt.GPTConfig.llama(
            vocab_size=8, max_seq_len=8, num_layers=1, hidden_size=4096, num_heads=32
        ).ffn_hidden_size
        == 10880
    )


@pytest.mark.parametrize(
    "flags, notice, check",
    [
        (
            ["--sequence-parallel"],
            "--sequence-parallel is off: it needs --tensor-model-parallel-size > 1",
            lambda a: not a.sequence_parallel,
        ),
        (
            ["--save-interval", "5"],
            "--save-interval 5 has no effect without --save DIR",
            lambda a: a.save is None,
        ),
        (
            ["--eval-interval", "5", "--eval-iters", "0"],
            "--eval-iters 0: no validation",
            lambda a: a.eval_iters == 0,
        ),
        (
            ["--no-load-optim"],
            "--no-load-optim has no effect without --load DIR",
            lambda a: a.load is None,
        ),
        (["--finetune"], "--finetune has no effect without --load DIR", lambda a: a.load is None),
        (
            ["--async-save"],
            "--async-save has no effect without --save DIR",
            lambda a: a.save is None,
        ),
        (["--split", "'99,1,0'"], None, lambda a: a.split == "99,1,0"),
        (["--split", '"99,1,0"'], None, lambda a: a.split == "99,1,0"),
        (
            ["--grad-reduce-in-bf16"],
            "--grad-reduce-in-bf16 has no effect without --bf16",
            lambda a: not a.grad_reduce_in_bf16,
        ),
        (["--grad-reduce-in-bf16", "--bf16"], None, lambda a: a.grad_reduce_in_bf16),
        (["--recompute-activations"], None, lambda a: a.recompute_granularity == "selective"),
        (
            ["--num-experts", "4", "--moe-layer-recompute"],
            "--moe-layer-recompute is deprecated (as in Megatron): read as "
            "--recompute-granularity selective --recompute-modules core_attn moe",
            lambda a: (
                a.recompute_granularity == "selective"
                and a.recompute_modules == ["core_attn", "moe"]
            ),
        ),
        (
            [
                "--num-experts",
                "4",
                "--moe-router-score-function",
                "sigmoid",
                "--moe-router-pre-softmax",
            ],
            "--moe-router-pre-softmax has no effect with --moe-router-score-function sigmoid",
            lambda a: not a.moe_router_pre_softmax,
        ),
    ],
    ids=[
        "sp_at_tp1",
        "save_interval_without_save",
        "eval_iters_0",
        "no_load_optim_without_load",
        "finetune_without_load",
        "async_save_without_save",
        "single_quoted_split",
        "double_quoted_split",
        "grad_reduce_in_bf16_without_bf16",
        "grad_reduce_in_bf16",
        "recompute_activations_is_selective",
        "moe_layer_recompute_is_recompute_modules_moe",
        "pre_softmax_with_sigmoid",
    ],
)
def test_where_megatron_adjusts_and_goes_on_fmeg_warns_once_and_goes_on(flags, notice, check):
    a = parse_args(flags, world_size=1)
    assert validate(a, 1) == []
    assert check(a)
    assert a.notices == (
        [] if notice is None else [next(n for n in a.notices if n.startswith(notice))]
    )


def test_warmup_fraction_is_a_fraction_of_a_step_as_in_megatron():
    a = parse_args(["--lr-warmup-fraction", "0.15", "--train-iters", "20"], world_size=1)
    assert lr_steps(a) == (pytest.approx(3.0), 20, False)


RUNTIME = [
    "--manual-gc",
    "--manual-gc-interval",
    "10",
    "--empty-unused-memory-level",
    "1",
    "--overlap-param-gather",
    "--cross-entropy-loss-fusion",
    "--no-mmap-bin-files",
    "--profile",
    "--profile-step-start",
    "3",
    "--profile-step-end",
    "5",
    "--profile-ranks",
    "0",
    "1",
    "--ckpt-format",
    "torch_dist",
    "--distributed-timeout-minutes",
    "30",
]


def test_runtime_flags_of_megatron_scripts_are_accepted_and_named():
    a = parse_args([*RUNTIME, "--rope-type", "rope"], world_size=1)  # rope: what fmeg's RoPE is
    assert validate(a, 1) == [] and a.distributed_timeout_minutes == 30
    named = [line.split(":")[0] for line in ignored_flags(a)]
    assert sorted(named) == sorted(
        f for f in RUNTIME if f.startswith("--") and f != "--distributed-timeout-minutes"
    )


def test_moe_flags_without_experts_are_named_as_ignored_even_at_their_defaults(tmp_path):
    """Megatron runs a dense model when --num-experts is absent and ignores the --moe-* flags; fmeg
    names each one given, on the command line or in YAML, even at its default (it used to say
    nothing then)."""
    config = tmp_path / "run.yaml"
    config.write_text("moe-aux-loss-coeff: 0.0\n")
    a = parse_args(["--moe-router-topk", "2", "--config", str(config)], world_size=1)
    named = [line.split(":")[0] for line in ignored_flags(a)]
    assert "--moe-router-topk" in named and "--moe-aux-loss-coeff" in named
    assert not [n for n in ignored_flags(parse_args([], world_size=1)) if n.startswith("--moe")]


def test_the_flex_dispatcher_runs_as_alltoall_with_one_warning():
    """DeepSeek-V3's scripts ask for --moe-token-dispatcher-type flex (DeepEP's kernels): the same
    tokens reach the same experts as with alltoall, so fmeg runs alltoall and says so once
    (test_moe_layouts runs its curve)."""
    a = parse_args(
        ["--num-experts", "4", "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"],
        world_size=1,
    )
    assert a.moe_token_dispatcher_type == "alltoall"
    assert [n for n in a.notices if "flex" in n] == [
        "--moe-token-dispatcher-type flex runs as alltoall: the same tokens reach the same "
        "experts and the numbers are the same; DeepEP's and HybridEP's fused kernels are not in "
        "fmeg"
    ]
    assert any(n.startswith("--moe-enable-deepep: ") for n in ignored_flags(a))


@pytest.mark.slow
def test_a_first_run_may_name_a_load_directory_that_does_not_exist_yet(tmp_path):
    """Megatron scripts pass --load and --save the same directory from the first run on."""
    ckpt = tmp_path / "ckpt"
    flags = [
        "--load",
        str(ckpt),
        "--save",
        str(ckpt),
        "--train-iters",
        "3",
        "--lr-warmup-iters",
        "1",
        "--sequence-parallel",
        "--num-query-groups",
        "2",
    ]
    records, stdout = run_recipe(tmp_path, "first", 1, flags)
    assert len(records) == 3 and (ckpt / "latest_checkpointed_iteration.txt").is_file()
    assert f"--load {ckpt}: no checkpoint there yet" in stdout
    # sequence parallel at tp 1, query groups without the switch
    assert stdout.count("warning: ") == 2
    records, stdout = run_recipe(
        tmp_path, "second", 1, [*flags[:4], "--train-iters", "5", "--lr-warmup-iters", "1"]
    )
    assert [r["iteration"] for r in records] == [4, 5] and "resumed from" in stdout
    assert json.loads((ckpt / "iter_0000005" / "metadata.json").read_text())["scheduler_steps"] == 5


@pytest.mark.parametrize(
    "flags, expected",
    [
        ([], "gelu_tanh"),
        (["--no-bias-gelu-fusion"], "gelu"),
        (["--disable-bias-linear"], "gelu"),
        (["--openai-gelu", "--no-bias-gelu-fusion"], "gelu_tanh"),
        (["--swiglu"], "swiglu"),
    ],
)
def test_the_gelu_is_the_one_megatron_picks(flags, expected):
    """Megatron's default fuses the bias into GELU with the tanh approximation;
    --no-bias-gelu-fusion, or no biases (--disable-bias-linear turns the fusion off), gives torch's
    exact GELU."""
    from fmeg import ops
    from fmeg.config.megatron_flags import activation

    assert activation(parse_args(flags)) == expected
    fused = pytest.importorskip("megatron.core.fusions.fused_bias_gelu")
    x, bias = torch.randn(64, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(
        ops.gelu_tanh(x + bias), fused.bias_gelu(bias, x), rtol=1e-6, atol=1e-6
    )
    assert (ops.gelu(x) - ops.gelu_tanh(x)).abs().max() > 1e-5  # the choice changes the numbers


def test_mock_data_is_synthetic_documents_any_tokenizer_can_read(tmp_path):
    from fmeg.data.mock_corpus import mock_corpus

    data = mock_corpus(vocab_size=257, eod=256, directory=tmp_path)
    docs = [data[i] for i in range(50)]  # one sequence per document
    assert all(d[-1] == 256 and (d[:-1] < 256).all() for d in docs)
    # written once
    assert mock_corpus(vocab_size=257, eod=256, directory=tmp_path).prefix == data.prefix


def test_a_script_with_mock_data_and_the_older_rope_flag_trains(tmp_path):
    records, stdout = run_recipe(
        tmp_path,
        "mock",
        2,
        [
            "--mock-data",
            "--use-rotary-position-embeddings",
            "--train-iters",
            "4",
            "--lr-warmup-iters",
            "1",
        ],
    )
    assert len(records) == 4 and records[-1]["lm_loss"] < records[0]["lm_loss"]
    assert "--mock-data and --data-path are alternatives; give one" in validate(
        parse_args(["--mock-data", "--data-path", "x"]), 1
    )
    assert parse_args(["--use-rotary-position-embeddings"]).position_embedding_type == "rope"


@pytest.mark.slow
def test_layernorm_1p_centres_the_norm_weights_on_zero_and_computes_the_same_model(tmp_path):
    """--apply-layernorm-1p stores w = gamma - 1 (zeros at init) and scales by 1 + w: the same
    function and the same gradients (norm weights take no weight decay), so the same loss curve to
    rounding, with other numbers in the checkpoint; the exported Hugging Face model gets gamma = 1 +
    w back."""
    from fmeg.interop.hf import to_hf

    base = dict(vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4)
    plain, centred = gpt.GPTConfig.gpt2(**base), gpt.GPTConfig.gpt2(**base, norm_zero_centered=True)
    p_plain, p_centred = gpt.init(plain, 0), gpt.init(centred, 0)
    assert torch.equal(p_centred["final_norm"]["weight"], torch.zeros(32))
    tokens = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(
        gpt.apply(p_centred, tokens, centred), gpt.apply(p_plain, tokens, plain)
    )
    hf_logits = to_hf(p_centred, centred)(tokens).logits
    torch.testing.assert_close(hf_logits, gpt.apply(p_plain, tokens, plain), rtol=1e-5, atol=1e-5)

    flags = ["--train-iters", "6", "--lr-warmup-iters", "1"]
    want, _ = run_recipe(tmp_path, "plain", 1, flags)
    got, _ = run_recipe(tmp_path, "centred", 1, [*flags, "--apply-layernorm-1p"])
    assert [r["lm_loss"] for r in got] == pytest.approx([r["lm_loss"] for r in want], rel=1e-5)


def test_rotary_percent_rotates_the_leading_dimensions_as_megatron_core():
    core = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    from fmeg import ops

    config = gpt.GPTConfig(
        vocab_size=8,
        max_seq_len=8,
        num_layers=1,
        hidden_size=48,
        num_heads=3,
        kv_channels=16,
        rotary_percent=0.5,
        position="rope",
    )
    # megatron-core's, for the 8 rotated dims
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    freqs = torch.outer(torch.arange(8).float(), inv_freq)
    t_SBND = torch.randn(8, 2, 3, 16)
    want = core._apply_rotary_pos_emb_bshd(t_SBND, torch.cat([freqs, freqs], -1)[:, None, None, :])
    rope = ops.rope_cos_sin(torch.arange(8), config.rotary_dim, config.rope.theta)
    t_BNSD = t_SBND.permute(1, 2, 0, 3)
    got = self_attention._rotate(t_BNSD, rope, config.rotary_dim).permute(2, 0, 1, 3)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[..., 8:], t_SBND[..., 8:])


def test_kv_channels_sets_the_head_dimension_as_transformers_head_dim():
    """A Llama whose heads are wider than hidden / heads (Qwen3-style --kv-channels 128 at hidden
    2560 with 32 heads, shrunk): fmeg's logits equal transformers' after from_hf."""
    transformers = pytest.importorskip("transformers")
    from fmeg.interop.hf import from_hf, to_hf

    hf_config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    config, params = from_hf(model)
    assert config.head_dim == 16 and config.attention.kv_channels == 16
    tokens = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(
        gpt.apply(params, tokens, config), model(tokens).logits, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        to_hf(params, config)(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5
    )
    a = parse_args(["--kv-channels", "16", "--hidden-size", "30", "--num-attention-heads", "3"])
    assert validate(a, 1) == []


def test_decoupled_lr_moves_only_the_embedding_and_output_at_their_rate():
    from fmeg.parallel.mesh import Mesh
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings

    config = gpt.GPTConfig.gpt2(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        tie_embeddings=False,
    )
    mesh, layout = Mesh.single(), Layout()
    tokens = torch.randint(0, 64, (2, 16))
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
    after = {}
    for decoupled_lr in (None, 1e-2, 0.0):
        state = init_state(
            shard_params(gpt.init(config, 0), config, layout, mesh), config, layout, mesh
        )
        train_iteration(
            state,
            [batch],
            config=config,
            layout=layout,
            mesh=mesh,
            settings=StepSettings(
                lr=1e-2, weight_decay=0.1, clip_grad=1.0, decoupled_lr=decoupled_lr
            ),
        )
        after[decoupled_lr] = {p: v.clone() for p, v in tree.items(state.params)}
    start = dict(tree.items({0: gpt.init(config, 0)}))
    # decoupled = lr: no change
    assert all(torch.equal(after[None][p], after[1e-2][p]) for p in after[None])
    frozen = {"0.embedding.word.weight", "0.output.weight"}
    for path, value in after[0.0].items():
        assert torch.equal(value, start[path]) == (path in frozen), path


@pytest.mark.slow
def test_decoupled_lr_follows_megatron_cores_scheduler_and_is_layout_invariant(tmp_path):
    OptimizerParamScheduler = pytest.importorskip(
        "megatron.core.optimizer_param_scheduler"
    ).OptimizerParamScheduler
    from types import SimpleNamespace

    flags = ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3", "--lr-decay-style", "cosine"]
    single, _ = run_recipe(tmp_path, "single", 1, flags)
    groups = [
        {"params": [], "lr": 0.0, "weight_decay": 0.0},
        {"params": [], "lr": 0.0, "weight_decay": 0.0, "max_lr": 1e-2, "min_lr": 1e-3},
    ]
    scheduler = OptimizerParamScheduler(
        SimpleNamespace(param_groups=groups),
        init_lr=0.0,
        max_lr=3e-3,
        min_lr=0.0,
        lr_warmup_steps=16,
        lr_decay_steps=160,
        lr_decay_style="cosine",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=160,
        wd_incr_style="constant",
    )
    for r in single:
        assert (r["lr"], r["decoupled_lr"]) == pytest.approx(
            (groups[0]["lr"], groups[1]["lr"]), rel=1e-12
        )
        scheduler.step(increment=8)
    tp2pp2, _ = run_recipe(
        tmp_path,
        "tp2pp2",
        4,
        [*flags, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    )
    assert [r["lm_loss"] for r in tp2pp2] == pytest.approx([r["lm_loss"] for r in single], rel=1e-5)


def test_per_token_loss_weighs_every_token_of_the_global_batch_alike():
    """--calculate-per-token-loss: the loss and gradients are those of (sum of all token losses) /
    (number of tokens) over the whole global batch, whatever the microbatches' token counts; the
    default averages the microbatch means, which weighs a token of a sparsely masked microbatch
    more."""
    from fmeg.parallel.mesh import Mesh
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import evaluate, init_state, shard_params, train_iteration
    from fmeg.training.step_settings import StepSettings

    config = gpt.GPTConfig.gpt2(
        vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4
    )
    mesh, layout = Mesh.single(), Layout()
    g = torch.Generator().manual_seed(0)
    microbatches = []
    for keep in (0.9, 0.2):
        tokens = torch.randint(0, 64, (2, 16), generator=g)
        mask = (torch.rand(2, 16, generator=g) < keep).float()
        microbatches.append(
            {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": mask}
        )
    params = gpt.init(config, 0)

    def per_token(p):
        total = sum(
            gpt.output_loss(
                gpt.hidden_states(p, mb["tokens"], config),
                p["embedding"]["word"]["weight"],
                mb,
                config.vocab_size,
                reduction="sum",
            )
            for mb in microbatches
        )
        return total / sum(gpt.loss_tokens(mb) for mb in microbatches)

    want_grads, want_loss = torch.func.grad_and_value(per_token)(params)
    state = init_state(shard_params(params, config, layout, mesh), config, layout, mesh)
    m = train_iteration(
        state,
        microbatches,
        config=config,
        layout=layout,
        mesh=mesh,
        settings=StepSettings(lr=0.0, weight_decay=0.0, clip_grad=0.0, per_token=True),
    )
    torch.testing.assert_close(m["loss"], want_loss)
    torch.testing.assert_close(m["grad_norm"].float(), tree.global_norm(want_grads))
    mean_of_means = sum(gpt.loss(params, mb, config) for mb in microbatches) / 2
    assert abs(float(mean_of_means) - float(want_loss)) > 1e-3  # the two reductions differ here
    # validation, as Megatron reports it whatever the flags: [token losses, tokens], divided at the
    # end
    pair = evaluate(state.params, microbatches, config=config, layout=layout, mesh=mesh)
    torch.testing.assert_close((pair[0] / pair[1]).float(), want_loss)
    assert float(pair[1]) == float(sum(gpt.loss_tokens(mb) for mb in microbatches))


@pytest.mark.slow
def test_per_token_loss_is_layout_invariant_with_uneven_masks(tmp_path):
    flags = [
        "--calculate-per-token-loss",
        "--eod-mask-loss",
        "--train-iters",
        "6",
        "--lr-warmup-iters",
        "1",
        "--eval-interval",
        "3",
    ]
    single, _ = run_recipe(tmp_path, "single", 1, flags)
    dp2, _ = run_recipe(tmp_path, "dp2", 2, [*flags, "--use-distributed-optimizer"])
    pp2, _ = run_recipe(tmp_path, "pp2", 2, [*flags, "--pipeline-model-parallel-size", "2"])
    for key in ("lm_loss", "validation_lm_loss"):
        want = [r[key] for r in single if key in r]
        assert len(want) == (6 if key == "lm_loss" else 2)
        for other in (dp2, pp2):
            assert [r[key] for r in other if key in r] == pytest.approx(want, rel=1e-5)


def test_llama2_tokenizer_is_sentencepiece_with_a_leading_bos_and_eos_as_end_of_document(tmp_path):
    """Megatron's Llama2Tokenizer: a sentencepiece model; tokenize prepends BOS, eod is EOS. A tiny
    model is trained here; preprocess_data and the runner read it with --tokenizer-type
    Llama2Tokenizer."""
    spm = pytest.importorskip("sentencepiece")
    from fmeg.data.tokenizers import build_tokenizer
    from recipes import preprocess_data

    model = sentencepiece_model(tmp_path, vocab_size=60)
    tok = build_tokenizer("Llama2Tokenizer", model=model)
    sp = spm.SentencePieceProcessor(model_file=model)
    assert (
        tok.encode("the lazy fox") == [1, *sp.encode("the lazy fox")]
        and tok.eod == 2
        and tok.vocab_size == 60
    )
    assert tok.decode(tok.encode("the lazy fox")[1:]) == "the lazy fox"

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"text": f"the quick brown fox {i} jumps " * 20}) for i in range(60))
    )
    assert (
        preprocess_data.main(
            [
                "--input",
                str(corpus),
                "--output-prefix",
                str(tmp_path / "data"),
                "--append-eod",
                "--tokenizer-type",
                "Llama2Tokenizer",
                "--tokenizer-model",
                model,
            ]
        )
        == 0
    )
    records, stdout = run_recipe(
        tmp_path,
        "llama2_tok",
        1,
        [
            "--tokenizer-type",
            "Llama2Tokenizer",
            "--tokenizer-model",
            model,
            "--data-path",
            str(tmp_path / "data_text_document"),
            "--train-iters",
            "4",
            "--lr-warmup-iters",
            "1",
            "--seq-length",
            "32",
        ],
    )
    assert len(records) == 4 and "vocab 60 (padded to 128)" in stdout


TIKTOKEN_TEXTS = [
    "the quick brown fox",
    "The thicket, then 1234 ticks!\n\n  the end",
    "naïve café — ü",
    "",
]


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_ids_equal_megatron_cores_and_the_runner_trains_on_them(tmp_path, pattern):
    """Megatron's TikTokenizer: ids below --tiktoken-num-special-tokens are special (</s> = 2 ends a
    document), vocabulary rank r is id r + num_special, and --vocab-size counts both. The ids equal
    megatron-core's TikTokenTokenizer for both patterns; preprocess_data and the runner read the
    vocabulary."""
    pytest.importorskip("tiktoken")
    TikTokenTokenizer = pytest.importorskip(
        "megatron.core.tokenizers.text.libraries.tiktoken_tokenizer"
    ).TikTokenTokenizer
    from fmeg.data.tokenizers import build_tokenizer
    from recipes import preprocess_data

    vocab = tiktoken_vocabulary(tmp_path)  # 265 ranks
    ours = build_tokenizer(
        "TikTokenizer",
        model=vocab,
        tiktoken_pattern=pattern,
        vocab_size=265 + 16,
        tiktoken_num_special_tokens=16,
    )
    oracle = TikTokenTokenizer(vocab, num_special_tokens=16, vocab_size=265 + 16, pattern=pattern)
    for text in TIKTOKEN_TEXTS:
        assert ours.encode(text) == oracle.text_to_ids(text), text
        assert ours.decode(ours.encode(text)) == text
    assert (ours.vocab_size, ours.eod) == (281, oracle.eos_id) == (281, 2)
    assert ours.encode("the")[0] == 256 + 2 + 16  # the merge "the" is rank 258
    # Megatron cuts the vocabulary to --vocab-size
    cut = build_tokenizer(
        "TikTokenizer",
        model=vocab,
        tiktoken_pattern=pattern,
        vocab_size=256 + 16,
        tiktoken_num_special_tokens=16,
    )
    assert max(cut.encode("the thicket")) < 256 + 16

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"text": f"the quick brown fox {i} ticks " * 20}) for i in range(60))
    )
    flags = [
        "--tokenizer-type",
        "TikTokenizer",
        "--tokenizer-model",
        vocab,
        "--tiktoken-pattern",
        pattern,
        "--vocab-size",
        "285",
        "--tiktoken-num-special-tokens",
        "20",
    ]
    assert (
        preprocess_data.main(
            [
                "--input",
                str(corpus),
                "--output-prefix",
                str(tmp_path / "data"),
                "--append-eod",
                *flags,
            ]
        )
        == 0
    )
    records, stdout = run_recipe(
        tmp_path,
        "tiktoken",
        1,
        [
            *flags,
            "--data-path",
            str(tmp_path / "data_text_document"),
            "--train-iters",
            "3",
            "--lr-warmup-iters",
            "1",
            "--seq-length",
            "32",
        ],
    )
    assert len(records) == 3 and "vocab 285 (padded to 384)" in stdout


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--vocab-size", "2000"], "has 265 tokens, fewer than the 1000 that --vocab-size minus"),
        (["--tiktoken-num-special-tokens", "2"], "must be at least the 3 special tokens"),
        (
            ["--tiktoken-special-tokens", "<s>", "</s>"],
            "must be distinct and include <unk> <s> </s>",
        ),
    ],
)
def test_tiktokenizer_refuses_a_vocabulary_it_cannot_build_in_one_line(tmp_path, flags, needle):
    pytest.importorskip("tiktoken")
    from fmeg.data.tokenizers import build_tokenizer

    a = parse_args(
        [
            "--tokenizer-type",
            "TikTokenizer",
            "--tokenizer-model",
            tiktoken_vocabulary(tmp_path),
            "--tiktoken-pattern",
            "v2",
            "--vocab-size",
            "1265",
            *flags,
        ]
    )
    with pytest.raises(ValueError, match=needle):
        build_tokenizer(
            a.tokenizer_type,
            model=a.tokenizer_model,
            vocab_size=a.vocab_size,
            tiktoken_pattern=a.tiktoken_pattern,
            tiktoken_num_special_tokens=a.tiktoken_num_special_tokens,
            tiktoken_special_tokens=a.tiktoken_special_tokens,
        )


def test_gpt_sentencepiece_tokenizer_is_megatron_cores(tmp_path):
    """Megatron's GPTSentencePieceTokenizer: a sentencepiece model that adds no BOS; its ids, end of
    document and vocabulary equal megatron-core's tokenizer of that type, and the runner trains on
    it."""
    pytest.importorskip("sentencepiece")
    import types

    from megatron.core.tokenizers.text.utils.build_tokenizer import (
        build_tokenizer as megatron_build,
    )

    from fmeg.data.tokenizers import build_tokenizer

    model = sentencepiece_model(tmp_path, vocab_size=60)
    args = types.SimpleNamespace(
        tokenizer_type="GPTSentencePieceTokenizer",
        tokenizer_model=model,
        tokenizer_metadata=None,
        vocab_size=None,
        vocab_extra_ids=0,
        tokenizer_special_tokens=None,
        trust_remote_code=False,
        tokenizer_hf_use_fast=False,
        tokenizer_hf_include_special_tokens=False,
        rank=0,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
        tokenizer_sentencepiece_legacy=False,
    )
    theirs, ours = megatron_build(args), build_tokenizer("GPTSentencePieceTokenizer", model=model)
    for text in ("the lazy fox", "jumps over 12 the quick", ""):
        assert ours.encode(text) == list(theirs.tokenize(text))
    assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size)
    records, stdout = run_recipe(
        tmp_path,
        "gptsp",
        1,
        [
            "--tokenizer-type",
            "GPTSentencePieceTokenizer",
            "--tokenizer-model",
            model,
            "--mock-data",
            "--train-iters",
            "3",
            "--lr-warmup-iters",
            "1",
        ],
    )
    assert len(records) == 3 and "vocab 60 (padded to 128)" in stdout


def test_lr_warmup_init_starts_the_warmup_where_megatron_cores_scheduler_does():
    """The DeepSeek-V3 script's --lr-warmup-init: the warmup climbs from it, as megatron-core's
    scheduler's init_lr, step by step through warmup and cosine decay."""
    OptimizerParamScheduler = pytest.importorskip(
        "megatron.core.optimizer_param_scheduler"
    ).OptimizerParamScheduler
    from types import SimpleNamespace

    from fmeg.config.run_config import RunConfig

    a = parse_args(
        [
            "--lr",
            "3e-3",
            "--min-lr",
            "1e-4",
            "--lr-warmup-init",
            "1e-3",
            "--lr-warmup-iters",
            "5",
            "--lr-decay-style",
            "cosine",
            "--train-iters",
            "30",
        ],
        world_size=1,
    )
    schedule = RunConfig.from_args(a, 1, 256).training.lr
    groups = [{"params": [], "lr": 0.0, "weight_decay": 0.0}]
    megatron = OptimizerParamScheduler(
        SimpleNamespace(param_groups=groups),
        init_lr=1e-3,
        max_lr=3e-3,
        min_lr=1e-4,
        lr_warmup_steps=5,
        lr_decay_steps=30,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=30,
        wd_incr_style="constant",
    )
    for step in range(30):
        assert schedule(step) == pytest.approx(groups[0]["lr"], rel=1e-12), step
        megatron.step(increment=1)
    assert schedule(0) == 1e-3
