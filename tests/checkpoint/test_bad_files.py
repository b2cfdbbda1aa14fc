"""Damaged files and directories, each refused the way bad flags are (test_bad_input.py): exit 2,
exactly one `error:` line naming the file, the field or the tensor, no traceback, nothing written.
Transformers model directories for import-hf (truncated or bad-header safetensors, a config.json
that disagrees with the weights, pickled weights only, NaN and inf weights), fmeg checkpoints whose
metadata has a field of the wrong type, an MoE checkpoint transformers has no class for, and
unwritable log directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness.bad_input import T, assert_one_line_exit_2_nothing_left
from harness.hf_models import tiny_llama

transformers = pytest.importorskip("transformers")


def _mixtral(root: Path) -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    transformers.MixtralForCausalLM(config).save_pretrained(root)


def _gpt_oss(root: Path) -> None:
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=8,
    )
    transformers.GptOssForCausalLM(config).save_pretrained(root)


def _deepseek_v3(root: Path) -> None:
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=12,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(root)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_dirs")
    makers = {
        "llama": tiny_llama,
        "mixtral": _mixtral,
        "gpt_oss": _gpt_oss,
        "deepseek_v3": _deepseek_v3,
    }
    for name, make in makers.items():
        make(root / name)
    return {name: root / name for name in makers}


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _bad_header(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:20] = b"not json at "
    (path / "model.safetensors").write_bytes(bytes(data))


# A pickle (protocol 0, written out by hand) that, if anything unpickled it, would call
# builtins.open("unpickled_and_ran_code", "w") and so leave a file behind: the test checks that none
# appears.
HOSTILE_PICKLE = b"cbuiltins\nopen\n(Vunpickled_and_ran_code\nVw\ntR."


def _pickled_only(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(HOSTILE_PICKLE)


def _poison(value: float):
    def edit(path: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})

    return edit


def _missing_shard(path: Path) -> None:
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    (path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                }
            }
        )
    )


IMPORT_CASES = [  # (model, damage, needle)
    (
        "gpt_oss",
        lambda p: _edit_config(p, layer_types=["sliding_attention", "full_attention"]),
        "config.json: transformers refuses it: `num_hidden_layers` (4) must be equal to the "
        "number of `layer_types`",
    ),
    ("llama", _truncate, "model.safetensors: not a readable safetensors file"),
    ("llama", _bad_header, "model.safetensors: not a readable safetensors file"),
    (
        "mixtral",
        lambda p: _edit_config(p, num_local_experts=8),
        "config.json disagrees with the weights: model.layers.0.mlp.experts.down_proj is [4, 16, "
        "24]",
    ),
    (
        "llama",
        lambda p: _edit_config(p, num_hidden_layers=3),
        "model.layers.2.input_layernorm.weight (config.json asks",
    ),
    (
        "llama",
        lambda p: _edit_config(p, num_hidden_layers=1),
        "(the files hold it and config.json has no place",
    ),
    (
        "llama",
        lambda p: _edit_config(p, intermediate_size=48),
        "config.json disagrees with the weights",
    ),
    (
        "llama",
        _pickled_only,
        "holds only pickled weights (pytorch_model.bin) and fmeg never unpickles",
    ),
    (
        "llama",
        _poison(float("nan")),
        "weight model.layers.1.mlp.up_proj.weight holds NaN (1 of 512 values)",
    ),
    ("llama", _poison(float("inf")), "weight model.layers.1.mlp.up_proj.weight holds inf"),
    (
        "llama",
        lambda p: (p / "config.json").write_text("{not json"),
        "config.json: not readable JSON",
    ),
    ("llama", lambda p: (p / "config.json").unlink(), "no config.json"),
    ("llama", lambda p: _edit_config(p, model_type=None), "config.json: no model_type"),
    (
        "llama",
        lambda p: _edit_config(p, model_type="no_such_model"),
        "transformers cannot build the model from it",
    ),
    (
        "llama",
        _missing_shard,
        "model-00002-of-00002.safetensors: missing, though model.safetensors.index.json",
    ),
]


@pytest.mark.parametrize(
    "model, damage, needle", IMPORT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(IMPORT_CASES)]
)
def test_import_hf_of_a_damaged_directory_is_one_line(
    tmp_path, monkeypatch, hf_dirs, model, damage, needle
):
    shutil.copytree(hf_dirs[model], tmp_path / "hf")
    damage(tmp_path / "hf")
    assert_one_line_exit_2_nothing_left(
        tmp_path,
        monkeypatch,
        "convert_checkpoint",
        ["import-hf", "--input", f"{T}/hf", "--save", f"{T}/out"],
        needle,
    )


def test_the_undamaged_directories_import(tmp_path, hf_dirs, capsys):
    """Each imports; DeepSeek-V3 as transformers saves it (its config's default MTP depth, no MTP
    weights) imports without multi-token prediction and says so in one line."""
    from fmeg.checkpoint import Checkpoint, latest
    from recipes import convert_checkpoint

    for model in hf_dirs:
        assert (
            convert_checkpoint.main(
                ["import-hf", "--input", str(hf_dirs[model]), "--save", str(tmp_path / model)]
            )
            == 0
        )
        said = [
            line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")
        ]
        if model == "deepseek_v3":
            assert said == [
                "warning: config.json announces 1 MTP depths (num_nextn_predict_layers) and the "
                "files hold none (transformers saves none): imported without multi-token "
                "prediction"
            ]
            with Checkpoint.open(latest(tmp_path / model)) as ckpt:
                assert ckpt.meta["model"]["mtp_num_layers"] is None
        else:
            assert said == []


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    """A GPT-2-style checkpoint with experts, as gpt_pretrain --num-experts 4 writes with default
    flags."""
    from harness.checkpoints import save_one

    from fmeg.models import gpt

    config = gpt.GPTConfig(
        vocab_size=64,
        max_seq_len=16,
        num_layers=2,
        hidden_size=16,
        num_heads=4,
        num_experts=4,
        moe_router_topk=2,
    )
    root = tmp_path_factory.mktemp("moe") / "ck"
    save_one(root, 1, config)
    return root


def test_export_hf_of_an_moe_transformers_has_no_class_for_is_one_line(
    tmp_path, monkeypatch, moe_checkpoint
):
    shutil.copytree(moe_checkpoint, tmp_path / "ck")
    assert_one_line_exit_2_nothing_left(
        tmp_path,
        monkeypatch,
        "convert_checkpoint",
        ["export-hf", "--load", f"{T}/ck", "--output", f"{T}/hf"],
        "transformers' GPT-2 has no experts",
    )


def test_export_megatron_at_a_layout_megatron_cannot_load_is_one_line(
    tmp_path, monkeypatch, moe_checkpoint
):
    shutil.copytree(moe_checkpoint, tmp_path / "ck")
    assert_one_line_exit_2_nothing_left(
        tmp_path,
        monkeypatch,
        "convert_checkpoint",
        [
            "export-megatron",
            "--load",
            f"{T}/ck",
            "--save",
            f"{T}/out",
            "--expert-model-parallel-size",
            "3",
        ],
        "--expert-model-parallel-size 3 does not divide the model's --num-experts 4",
    )


@pytest.mark.skipif(
    not Path("/proc").is_dir(), reason="RLIMIT_FSIZE stands for a full disk on Linux"
)
@pytest.mark.parametrize("limit", [100, 4096])
def test_export_megatron_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, limit):
    """The file-size limit makes the OS refuse a write past `limit` bytes, as a full disk does,
    inside DCP's writer: one line, exit 2, no directory left."""
    import resource
    import signal
    import subprocess
    import sys

    from fmeg.models import gpt
    from fmeg.parallel.mesh import Mesh
    from fmeg.training.checkpoint_state import save_single_rank
    from fmeg.parallel.layout import Layout
    from fmeg.training.parallel_step import init_state, shard_params

    config = gpt.GPTConfig.gpt2(
        vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4
    )
    mesh, layout = Mesh.single(), Layout()
    state = init_state(
        shard_params(gpt.init(config, 0), config, layout, mesh), config, layout, mesh
    )
    save_single_rank(tmp_path / "ck", 1, state, config, {})

    def full_disk():
        # the write fails with EFBIG instead of killing
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.convert_checkpoint",
            "export-megatron",
            "--load",
            str(tmp_path / "ck"),
            "--save",
            str(tmp_path / "out"),
        ],
        preexec_fn=full_disk,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "nothing was written" in errors[0], (
        out.stderr[-3000:]
    )
    assert "Traceback" not in out.stderr and not (tmp_path / "out").exists()


METADATA_CASES = [  # (field path, value, needle)
    (("model", "num_layers"), "2", "model field num_layers is '2' (str), not int"),
    (("model", "hidden_dropout"), "0.1", "model field hidden_dropout is '0.1' (str), not float"),
    (("model", "tie_embeddings"), 1, "model field tie_embeddings is 1 (int), not bool"),
    (("model", "rope_scaling"), [8.0, 1.0], "model field rope_scaling is (8.0, 1.0)"),
    (("iteration",), "1", "iteration is '1', not a whole number >= 0"),
    (("consumed_samples",), None, "consumed_samples is None, not a whole number >= 0"),
    (("layout",), "tp1", "layout is str, not an object"),
]


@pytest.mark.parametrize("command", ["generate", "gpt_pretrain", "consolidate"])
@pytest.mark.parametrize(
    "field, value, needle", METADATA_CASES, ids=[".".join(c[0]) for c in METADATA_CASES]
)
def test_metadata_with_a_field_of_the_wrong_type_is_one_line(
    tmp_path, monkeypatch, command, field, value, needle
):
    from harness.checkpoints import save_one

    path = save_one(tmp_path / "ck", 1)[0]
    meta = json.loads((path / "metadata.json").read_text())
    target = meta
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    (path / "metadata.json").write_text(json.dumps(meta))
    argv = {
        "generate": (
            "generate",
            [
                "--load",
                f"{T}/ck",
                "--prompt",
                "1 2",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "64",
            ],
        ),
        "gpt_pretrain": ("gpt_pretrain", ["--load", f"{T}/ck", "--train-iters", "2"]),
        "consolidate": (
            "convert_checkpoint",
            ["consolidate", "--load", f"{T}/ck", "--output", f"{T}/x.st"],
        ),
    }
    name, args = argv[command]
    assert_one_line_exit_2_nothing_left(tmp_path, monkeypatch, name, args, needle)


def test_a_damaged_loss_scale_is_a_checkpoint_error_when_fp16_resumes():
    from fmeg.checkpoint import CheckpointError
    from fmeg.optim import loss_scale
    from fmeg.training.policies import resume

    meta = {"iteration": 1, "consumed_samples": 4}
    for damaged in ({"scale": "big"}, {"bogus": 1}):
        with pytest.raises(CheckpointError, match="loss_scale .* is not a loss scaler's state"):
            resume(
                {**meta, "loss_scale": damaged},
                finetune=False,
                no_load_optim=False,
                in_samples=False,
                scaler=loss_scale.initial(),
                path="ck/iter_0000001",
            )


@pytest.mark.skipif(
    not Path("/proc").is_dir(), reason="needs a read-only place root cannot write either"
)
@pytest.mark.parametrize("flag", ["--wandb-save-dir", "--save", "--tensorboard-dir"])
def test_an_unwritable_log_directory_is_one_line_before_any_work(tmp_path, monkeypatch, flag):
    pytest.importorskip("wandb")
    assert_one_line_exit_2_nothing_left(
        tmp_path,
        monkeypatch,
        "gpt_pretrain",
        ["--wandb-project", "p", flag, "/proc/fmeg_cannot_write_here"],
        f"{flag} /proc/fmeg_cannot_write_here: /proc is not writable",
    )


def test_a_wandb_save_dir_under_a_file_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    (tmp_path / "afile").write_text("")
    assert_one_line_exit_2_nothing_left(
        tmp_path,
        monkeypatch,
        "gpt_pretrain",
        ["--wandb-project", "p", "--wandb-save-dir", f"{T}/afile/wandb"],
        "is a file, so no directory can be made under it",
    )


def test_every_command_refuses_a_damaged_input_of_its_own_as_users_run_it(tmp_path, hf_dirs):
    """Each command, run as a user runs it (its own process; the runner also under fmeg.launch on 2
    ranks), given a damaged file: exit 2, one `error:` line naming the file or field, no traceback,
    nothing written."""
    import os
    import subprocess
    import sys

    import numpy as np

    from fmeg.data.indexed import IndexedDatasetBuilder
    from harness.checkpoints import save_one

    builder = IndexedDatasetBuilder(tmp_path / "data", dtype=np.uint16)
    for n in (40, 50, 60):
        builder.add_document(np.arange(n) % 250)
    builder.finalize()
    (tmp_path / "data.idx").write_bytes((tmp_path / "data.idx").read_bytes()[:20])
    path = save_one(tmp_path / "ck", 1)[0]
    meta = json.loads((path / "metadata.json").read_text())
    meta["model"]["num_layers"] = "2"
    (path / "metadata.json").write_text(json.dumps(meta))
    cut = next(save_one(tmp_path / "ck_cut", 1)[0].glob("rank_*.safetensors"))
    cut.write_bytes(cut.read_bytes()[:100])  # the header cut off
    shutil.copytree(hf_dirs["llama"], tmp_path / "hf")
    _truncate(tmp_path / "hf")
    (tmp_path / "in.jsonl").write_bytes(b"\xff\xfe not text\n")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
    # the checkpoints' vocabulary
    null64 = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    commands = {  # command: (argv, what the line names)
        "gpt_pretrain": (
            ["-m", "recipes.gpt_pretrain", "--data-path", "data", *null, "--train-iters", "1"],
            "data.idx",
        ),
        "train_single": (
            ["-m", "recipes.train_single", "--data-path", "data", "--vocab-size", "256"],
            "data.idx",
        ),
        "generate": (
            ["-m", "recipes.generate", "--load", "ck", "--prompt", "1 2", *null64],
            "num_layers is '2'",
        ),
        "serve": (
            ["-m", "recipes.serve", "--load", "ck_cut", "--port", "0", *null64],
            "rank_00000.safetensors",
        ),
        "preprocess_data": (
            ["-m", "recipes.preprocess_data", "--input", "in.jsonl", "--output-prefix", "out"],
            "in.jsonl:1: not UTF-8",
        ),
        "convert_checkpoint": (
            ["-m", "recipes.convert_checkpoint", "import-hf", "--input", "hf", "--save", "imp"],
            "model.safetensors: not a readable safetensors file",
        ),
        "fmeg.launch": (
            [
                "-m",
                "fmeg.launch",
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "recipes.gpt_pretrain",
                "--data-path",
                "data",
                *null,
                "--train-iters",
                "1",
            ],
            "data.idx",
        ),
    }
    before = sorted(tmp_path.rglob("*"))
    env = {**os.environ, "FMEG_CACHE": str(tmp_path / ".cache")}
    runs = {
        name: subprocess.Popen(
            [sys.executable, *argv],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for name, (argv, _) in commands.items()
    }
    for name, proc in runs.items():
        _, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and "Traceback" not in err, (name, proc.returncode, err[-2000:])
        assert len(errors) == 1 and commands[name][1] in errors[0], (name, err[-2000:])
    left = sorted(p for p in tmp_path.rglob("*") if ".cache" not in p.parts)
    assert left == [p for p in before if ".cache" not in p.parts], set(left) ^ set(before)
