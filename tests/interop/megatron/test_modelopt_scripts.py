"""Megatron-LM's post-training (ModelOpt) fine-tuning script,
examples/post_training/modelopt/finetune.sh with its conf/qwen/Qwen3-8B.sh model flags, runs through
recipes.gpt_pretrain with its flags unchanged apart from sizes and the data: finetune.sh reads a
Hugging Face Hub dataset (--finetune-hf-dataset, which fmeg refuses in one line: no download inside
a run); here its conversations are a JSONL file read with Megatron's --sft flags.
"""

import json
import random

import pytest

from harness.runner import run_group, run_recipe


def qwen3_8b_model_args(seq_length: int) -> list[str]:
    """conf/qwen/Qwen3-8B.sh's MODEL_ARGS, in its order."""
    return [
        "--save-interval",
        "100000",
        "--micro-batch-size",
        "1",
        "--bf16",
        "--no-masked-softmax-fusion",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--position-embedding-type",
        "rope",
        "--no-rope-fusion",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--ffn-hidden-size",
        "192",  # sizes: 36, 4096, 12288
        "--num-attention-heads",
        "4",
        "--group-query-attention",
        "--num-query-groups",
        "2",  # sizes: 32, 8
        "--kv-channels",
        "16",
        "--qk-layernorm",
        "--seq-length",
        str(seq_length),  # sizes: 128, 4096
        "--max-position-embeddings",
        "40960",
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--make-vocab-size-divisible-by",
        "1187",
        "--use-mcore-models",
        "--rotary-percent",
        "1.0",
        "--rotary-base",
        "1000000",
        "--no-bias-swiglu-fusion",
    ]


def finetune_sh(
    model_args: list[str], tp: int, tokenizer: str, ckpt: str, save: str, data: list[str]
) -> list[str]:
    """finetune.sh's command line, in its order (TP, ETP, EP, PP, CP as its variables; the default
    arguments)."""
    return [
        *model_args,
        "--tensor-model-parallel-size",
        str(tp),
        "--expert-tensor-parallel-size",
        "1",
        "--expert-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--context-parallel-size",
        "1",
        "--tokenizer-model",
        tokenizer,
        "--load",
        ckpt,
        "--save",
        save,
        # MLM_DATA_ARGS (sizes: 128000 samples), with the data as JSONL
        "--train-samples",
        "24",
        "--lr-decay-samples",
        "24",
        "--lr-warmup-samples",
        "0",
        "--split",
        "100,0,0",
        *data,
        # MLM_OPTIM_ARGS
        "--lr",
        "5.0e-5",
        "--min-lr",
        "1.0e-7",
        "--lr-decay-style",
        "cosine",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0.0",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--init-method-std",
        "0.010",
        "--use-distributed-optimizer",
        # MLM_TRAIN_ARGS
        "--no-gradient-accumulation-fusion",
        "--reset-position-ids",
        "--reset-attention-mask",
        "--eod-mask-loss",
        "--micro-batch-size",
        "1",
        "--attention-dropout",
        "0.0",
        "--hidden-dropout",
        "0.0",
        "--no-check-for-nan-in-loss-and-grad",
        # MLM_EVAL_ARGS
        "--eval-iters",
        "1",
        "--eval-interval",
        "1000",
        "--save-interval",
        "1000",
        "--log-interval",
        "100",
        # MLM_DEFAULT_ARGS
        "--distributed-timeout-minutes",
        "30",
        "--auto-detect-ckpt-format",
        "--export-te-mcore-model",
        "--finetune",
    ]


def write_qwen3(directory, tokenizer_dir) -> None:
    """A random Qwen3 of the shrunk conf's sizes (rope theta 1e6, norm epsilon 1e-5: Megatron's
    defaults, which the conf keeps) with the chat tokenizer's vocabulary."""
    import transformers

    from fmeg.data.tokenizers import HuggingFaceTokenizer

    vocab = HuggingFaceTokenizer(str(tokenizer_dir)).vocab_size
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        max_position_embeddings=40960,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory)


def test_qwen3_finetune_script_fine_tunes_an_imported_model_at_tp_2(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    import sys

    from recipes import tiny_chat_model

    model = tmp_path / "qwen3"
    model.mkdir()
    tiny_chat_model.write_tokenizer(model)
    write_qwen3(model, model)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(json.dumps(c) + "\n" for c in tiny_chat_model.conversations(random.Random(0), 200))
    )
    out = run_group(
        [
            sys.executable,
            "-m",
            "recipes.convert_checkpoint",
            "import-hf",
            "--input",
            str(model),
            "--save",
            str(tmp_path / "imported"),
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = [
        "--sft",
        "--tokenizer-type",
        "SFTTokenizer",
        "--data-path",
        str(chat),
        "--global-batch-size",
        "4",
    ]
    flags = finetune_sh(
        qwen3_8b_model_args(128),
        2,
        str(model),
        str(tmp_path / "imported"),
        str(tmp_path / "sft"),
        data,
    )
    records, stdout = run_recipe(tmp_path, "finetune", 2, flags, common=[])
    assert "world 2 = tp 2 x pp 1 (x1 virtual) x dp 1" in stdout and "bfloat16" in stdout
    assert (
        f"fine-tuning from {tmp_path / 'imported' / 'iter_0000000'} (iteration 0, 0 samples; "
        "weights only)" in stdout
    )
    for flag in (
        "--export-te-mcore-model",
        "--auto-detect-ckpt-format",
        "--no-rope-fusion",
        "--use-mcore-models",
    ):
        assert f"ignored {flag}: " in stdout
    assert "warning: --split 100,0,0 gives validation no share: no validation" in stdout
    train = [r for r in records if "lm_loss" in r]
    # 24 samples of 4: --finetune starts at 0
    assert [r["iteration"] for r in train] == list(range(1, 7))
    assert not [r for r in records if "validation_lm_loss" in r]
    assert (tmp_path / "sft" / "latest_checkpointed_iteration.txt").read_text() == "6"
