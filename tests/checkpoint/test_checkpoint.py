"""Checkpoints: boxes of global tensors in safetensors files + JSON; bitwise resume in the same
layout, resharding to others, and corrupt, partial or mismatched checkpoints refused with one line
naming the file."""

import json
import sys
import time

import pytest
import torch

from fmeg import checkpoint, tree
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.training.checkpoint_state import read_params
from fmeg.parallel.layout import Layout
from fmeg.training.run_state import check_model, read_state
from harness.runner import run_layout, run_recipe
from harness.checkpoints import CONFIG, _Cfg, one_rank_state, save_one
from harness.paths import ROOT


def test_round_trip_keeps_every_buffer_bitwise(tmp_path):
    path, _, saved = save_one(tmp_path, 10)
    assert (tmp_path / checkpoint.LATEST).read_text() == "10" and not list(tmp_path.glob("*.tmp*"))
    loaded = one_rank_state(seed=1)
    with checkpoint.Checkpoint.open(path) as ckpt:
        check_model(ckpt, CONFIG)
        read_state(ckpt, loaded, _Cfg(CONFIG), Mesh.single(), optimizer=True)
    for a, b in zip(loaded.buffers().values(), saved.buffers().values()):
        assert torch.equal(a[0], b[0])
    assert int(loaded.count) == 10 and loaded.steps == 10
    with checkpoint.Checkpoint.open(path) as ckpt:
        names = set(ckpt.entries)
    assert "params/layers.0.attn.qkv.weight" in names and "mu/embedding.word.weight" in names


def test_files_are_plain_safetensors_whose_tensors_name_their_place(tmp_path):
    """Any safetensors reader opens a rank's file; each tensor's name says which box of which global
    tensor it holds."""
    from safetensors import safe_open

    path, params, _ = save_one(tmp_path, 1)
    with safe_open(str(path / "rank_00000.safetensors"), "pt") as f:
        qkv = f.get_tensor("params/layers.1.attn.qkv.weight[0:96,0:32]")
    assert torch.equal(qkv, params[0]["layers"][1]["attn"]["qkv"]["weight"])


def _corrupt(path, key):
    """Flip a byte inside the data of one tensor of a rank's file."""
    from fmeg.checkpoint.safetensors_file import SafetensorsFile

    with SafetensorsFile(path) as f:
        at = f.data_start + f.header[key]["data_offsets"][0] + 3
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_naming_the_file_and_the_tensor(tmp_path):
    path, _, _ = save_one(tmp_path, 1)
    _corrupt(path / "rank_00000.safetensors", "mu/layers.0.mlp.fc2.weight[0:32,0:128]")
    with checkpoint.Checkpoint.open(path) as ckpt:
        # the weights are intact: only mu was hit
        read_params(ckpt, CONFIG, Layout(), Mesh.single())
        with pytest.raises(
            checkpoint.CheckpointError,
            match=r"rank_00000\.safetensors: tensor "
            r"mu/layers\.0\.mlp\.fc2\.weight\[0:32,0:128\]: checksum mismatch",
        ):
            read_state(ckpt, one_rank_state(), _Cfg(CONFIG), Mesh.single(), optimizer=True)


@pytest.mark.parametrize("damage", ["missing", "truncated", "header"])
def test_a_missing_truncated_or_garbled_file_is_refused_naming_it(tmp_path, damage):
    path, _, _ = save_one(tmp_path, 1)
    shard = path / "rank_00000.safetensors"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        shard.write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + shard.read_bytes()[24:]
        )
    words = {
        "missing": "missing",
        "truncated": "truncated",
        "header": "header is not a JSON object",
    }[damage]
    with checkpoint.Checkpoint.open(path) as ckpt:
        with pytest.raises(
            checkpoint.CheckpointError, match=rf"rank_00000\.safetensors: .*{words}"
        ):
            read_state(ckpt, one_rank_state(), _Cfg(CONFIG), Mesh.single(), optimizer=True)


def test_another_models_checkpoint_is_refused_naming_what_differs(tmp_path):
    path, _, _ = save_one(tmp_path, 1)
    with checkpoint.Checkpoint.open(path) as ckpt:
        with pytest.raises(
            checkpoint.CheckpointError, match=r"metadata\.json: .*differs from the flags in hidden_"
        ):
            check_model(ckpt, CONFIG.replace(hidden_size=64))


def test_a_partial_checkpoint_is_ignored_with_a_warning(tmp_path):
    save_one(tmp_path, 5)
    (tmp_path / "iter_0000010.tmp").mkdir()
    (tmp_path / "iter_0000010.tmp" / "rank_00000.safetensors").write_bytes(b"half")
    with pytest.warns(UserWarning, match="unfinished checkpoint"):
        assert checkpoint.latest(tmp_path).name == "iter_0000005"


def test_keep_last(tmp_path):
    for i in (1, 2, 3):
        save_one(tmp_path, i)
    tmp = checkpoint.temporary_dir(tmp_path, 4, "0")
    tmp.mkdir()
    checkpoint.write_rank(tmp, 0, {}, [])
    checkpoint.finalize(tmp_path, 4, {"world_size": 1}, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003", "iter_0000004"]


def resume(tmp_path, name, save_nproc, save_flags, load_nproc, load_flags, said=None):
    """Losses of iterations 11..20 after saving at 10 in one layout and loading in another; said:
    a list the second run's stdout is appended to."""
    ckpt = tmp_path / f"{name}_ckpt"
    run_layout(
        tmp_path,
        f"{name}_first",
        save_nproc,
        save_flags + ["--save", str(ckpt), "--train-iters", "10", "--lr-decay-iters", "20"],
    )
    records, stdout = run_recipe(
        tmp_path, f"{name}_second", load_nproc, load_flags + ["--load", str(ckpt)]
    )
    if said is not None:
        said.append(stdout)
    return [r["lm_loss"] for r in records if "lm_loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(reference):
    return reference["plain"]


def test_single_rank_resume_is_bitwise(tmp_path, uninterrupted):
    assert resume(tmp_path, "single", 1, [], 1, []) == uninterrupted[10:]


def test_resharding_tp2_to_dp2_zero1(tmp_path, uninterrupted):
    said = []
    got = resume(
        tmp_path,
        "tp2",
        2,
        ["--tensor-model-parallel-size", "2"],
        2,
        ["--tensor-model-parallel-size", "1", "--use-distributed-optimizer"],
        said,
    )
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, uninterrupted[10:])) and len(got) == 10
    # the saved layout in the start line's words, not the metadata's dict
    assert "(iteration 10, 80 samples; resharded from tp 2 x pp 1 (x1 virtual) x dp 1, " in said[0]


# fp16 starts below overflow: whether a step near the threshold overflows depends on the layout's
# partial sums
@pytest.mark.parametrize(
    "dtype",
    [["--bf16"], pytest.param(["--fp16", "--initial-loss-scale", "4096"], marks=pytest.mark.slow)],
    ids=["bf16", "fp16"],
)
def test_mixed_precision_with_the_distributed_optimizer_saves_resumes_bitwise_and_at_another_layout(
    tmp_path, dtype
):
    """Megatron's most common configurations: bf16 or fp16 with ZeRO-1 save (the fp32 main-weight
    slices and the loss scaler included), resume bitwise in their own layout, and continue their
    curve at tp 2 without ZeRO-1 (to half-precision rounding)."""
    zero = [*dtype, "--use-distributed-optimizer"]
    full = run_layout(tmp_path, "zero_full", 2, zero)
    assert resume(tmp_path, "zero", 2, zero, 2, zero) == full[10:]
    other = run_layout(
        tmp_path,
        "tp2",
        2,
        [*dtype, "--tensor-model-parallel-size", "2", "--load", str(tmp_path / "zero_ckpt")],
    )
    assert len(other) == 10 and all(abs(a - b) <= 1e-2 * b for a, b in zip(other, full[10:]))


def test_no_load_optim_and_finetune_take_the_weights_only(tmp_path, uninterrupted):
    ckpt = tmp_path / "ck"
    run_layout(
        tmp_path, "first", 1, ["--save", str(ckpt), "--train-iters", "10", "--lr-decay-iters", "20"]
    )
    fresh = run_layout(tmp_path, "no_optim", 1, ["--load", str(ckpt), "--no-load-optim"])
    # the same weights and samples give iteration 11's loss; then a fresh Adam state moves them
    # differently
    assert len(fresh) == 10 and fresh[0] == uninterrupted[10] and fresh[1] != uninterrupted[11]
    tuned, stdout = run_recipe(tmp_path, "finetune", 1, ["--load", str(ckpt), "--finetune"])
    assert "fine-tuning from" in stdout and "weights only" in stdout
    assert [(r["iteration"], r["consumed_samples"]) for r in tuned[:2]] == [
        (1, 8),
        (2, 16),
    ] and len(tuned) == 20
    # iteration 1's samples, seen by trained weights
    assert tuned[0]["lm_loss"] < uninterrupted[0] - 0.5


def test_no_save_optim_writes_the_weights_only_which_resume_with_no_load_optim(
    tmp_path, uninterrupted
):
    """Megatron's --no-save-optim: the weights alone (no moments, no step count); resuming such a
    checkpoint needs --no-load-optim (or --finetune), else one line says so, and with it iteration
    11 sees the same weights and samples as the uninterrupted run."""
    from safetensors import safe_open

    from harness.runner import run_group

    light = tmp_path / "light"
    run_layout(
        tmp_path,
        "light",
        1,
        ["--save", str(light), "--train-iters", "10", "--lr-decay-iters", "20", "--no-save-optim"],
    )
    names = set()
    for path in (light / "iter_0000010").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names |= {name.split("/")[0] for name in f.keys()}
    assert names == {"params"}
    refused = run_group(
        [
            sys.executable,
            "-m",
            "recipes.gpt_pretrain",
            "--load",
            str(light),
            "--train-iters",
            "20",
            "--num-layers",
            "4",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "16",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "2",
        ]
    )
    assert (
        refused.returncode == 2
        and "holds no optimizer state (saved with --no-save-optim)" in refused.stderr
    )
    fresh = run_layout(tmp_path, "no_optim", 1, ["--load", str(light), "--no-load-optim"])
    assert len(fresh) == 10 and fresh[0] == uninterrupted[10]


@pytest.mark.slow
def test_tp2_pp2_resume_is_bitwise(tmp_path):
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert (
        resume(tmp_path, "tp2pp2", 4, flags, 4, flags)
        == run_layout(tmp_path, "tp2pp2_full", 4, flags)[10:]
    )


@pytest.mark.slow
def test_dp2_zero1_resume_is_bitwise(tmp_path):
    flags = ["--tensor-model-parallel-size", "1", "--use-distributed-optimizer"]
    assert (
        resume(tmp_path, "zero", 2, flags, 2, flags)
        == run_layout(tmp_path, "zero_full", 2, flags)[10:]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "target",
    [
        ["--tensor-model-parallel-size", "1", "--use-distributed-optimizer"],
        ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4"],
        ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "1"],
    ],
    ids=["tp1_pp1_dp2_zero1", "pp4", "tp4"],
)
def test_resharding_from_tp2_pp2(tmp_path, uninterrupted, target):
    source = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    got = resume(
        tmp_path, "reshard", 4, source, 2 if "--use-distributed-optimizer" in target else 4, target
    )
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, uninterrupted[10:])) and len(got) == 10


def test_no_pickle_anywhere():
    """Nothing is unpickled but Megatron's own checkpoint metadata, through an unpickler that
    resolves only the classes it needs (fmeg/interop/megatron/safe_pickle.py;
    tests/interop/megatron/test_megatron_checkpoint.py refuses others)."""
    import re

    root = ROOT
    restricted = root / "fmeg" / "interop" / "megatron" / "safe_pickle.py"
    for path in list(root.glob("fmeg/**/*.py")) + list(root.glob("recipes/*.py")):
        text = path.read_text()
        if path == restricted:
            assert "def find_class" in text and not re.search(
                r"pickle\.loads?\(|pickle\.Unpickler\(", text
            )
            continue
        assert not re.search(r"^\s*import pickle|pickle\.load", text, re.M), path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, path


def test_consolidate_export_to_hugging_face_and_import(tmp_path):
    transformers = pytest.importorskip("transformers")
    from recipes import convert_checkpoint

    run_layout(
        tmp_path,
        "run",
        2,
        ["--tensor-model-parallel-size", "2", "--train-iters", "4", "--save", str(tmp_path / "ck")],
    )
    assert (
        convert_checkpoint.main(
            [
                "consolidate",
                "--load",
                str(tmp_path / "ck"),
                "--output",
                str(tmp_path / "full.safetensors"),
            ]
        )
        == 0
    )
    from safetensors import safe_open

    with safe_open(str(tmp_path / "full.safetensors"), "pt") as f:
        assert "layers.0.attn.qkv.weight" in f.keys() and "fmeg_config" in f.metadata()
        assert f.get_slice("embedding.word.weight").get_shape() == [257, 32]  # no padding rows
    assert (
        convert_checkpoint.main(
            ["export-hf", "--load", str(tmp_path / "ck"), "--output", str(tmp_path / "hf")]
        )
        == 0
    )
    config, params = convert_checkpoint.load_full(str(tmp_path / "ck"))
    # the byte tokenizer, padded for tp 2
    assert (config.vocab_size, config.padded_vocab_size) == (257, 512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.vocab_size == 257  # the real vocabulary
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        ours, theirs = gpt.apply(params, tokens, config), hf(tokens).logits
    assert ours.shape == theirs.shape == (2, 16, 257)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * ours.abs().max().item())
    assert (
        convert_checkpoint.main(
            ["import-hf", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "imp")]
        )
        == 0
    )
    _, imported = convert_checkpoint.load_full(str(tmp_path / "imp"))
    unpadded = gpt.repad_vocab(params, config, 257)
    assert all(
        torch.equal(a, b) for a, b in zip(tree.tree_leaves(imported), tree.tree_leaves(unpadded))
    )
    assert (
        convert_checkpoint.main(["consolidate", "--load", str(tmp_path / "nope"), "--output", "x"])
        == 2
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["consolidate", "--load", "ck", "--output", "taken.safetensors"],
            "exists; choose a new file name",
        ),
        (
            ["consolidate", "--load", "ck", "--output", "missing_dir/full.safetensors"],
            "no directory",
        ),
        (
            ["export-hf", "--load", "ck", "--output", "taken.safetensors"],
            "is not an empty directory",
        ),
        (["import-hf", "--input", "no_such_model", "--save", "imp"], "no such directory"),
    ],
    ids=[
        "consolidate_over_a_file",
        "consolidate_into_a_missing_dir",
        "export_over_a_file",
        "import_missing",
    ],
)
def test_conversions_never_overwrite_or_download_and_say_so_in_one_line(
    tmp_path, monkeypatch, capsys, args, needle
):
    from recipes import convert_checkpoint

    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken.safetensors").write_bytes(b"keep me")
    start = time.perf_counter()
    assert convert_checkpoint.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --") and needle in err[0]
    assert (
        tmp_path / "taken.safetensors"
    ).read_bytes() == b"keep me" and time.perf_counter() - start < 5


def test_metadata_describes_each_piece_as_a_box_of_its_global_tensor(tmp_path):
    run_layout(
        tmp_path,
        "tp2",
        2,
        [
            "--tensor-model-parallel-size",
            "2",
            "--train-iters",
            "3",
            "--save",
            str(tmp_path / "ck"),
            "--use-distributed-optimizer",
        ],
    )
    meta = json.loads((checkpoint.latest(tmp_path / "ck") / "metadata.json").read_text())
    pieces = {
        (f, p["name"], tuple(p["offset"])): p for f, r in meta["files"].items() for p in r["pieces"]
    }
    qkv = [
        pieces[(f"rank_0000{r}.safetensors", "params/layers.0.attn.qkv.weight", (48 * r, 0))]
        for r in (0, 1)
    ]
    assert all(q["global_shape"] == [96, 32] and q["shape"] == [48, 32] for q in qkv)
    proj = pieces[("rank_00001.safetensors", "params/layers.0.attn.proj.weight", (0, 16))]
    assert proj["shape"] == [32, 16] and proj["global_shape"] == [32, 32]
    norms = [k for k in pieces if k[1] == "params/layers.0.attn_norm.weight"]
    assert len(norms) == 1 and pieces[norms[0]]["shape"] == [32]  # replicated over tp: written once
    assert len(meta["files"]["rank_00000.safetensors"]["pieces"][0]["crc32"]) >= 1


def test_consolidate_on_a_full_disk_is_one_line_and_leaves_no_temporary(
    tmp_path, monkeypatch, capsys
):
    import errno

    from recipes import convert_checkpoint

    save_one(tmp_path / "ck", 1)
    out = tmp_path / "out"
    out.mkdir()

    def full_disk(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(convert_checkpoint, "save_file", full_disk)
    assert (
        convert_checkpoint.main(
            [
                "consolidate",
                "--load",
                str(tmp_path / "ck"),
                "--output",
                str(out / "full.safetensors"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: --output {out / 'full.safetensors'}: cannot write it"
    ), err
    assert "No space left on device" in err[0] and list(out.iterdir()) == []


def test_a_checkpoint_holds_one_copy_of_each_replicated_tensor_and_resumes_on_the_curve(
    tmp_path, uninterrupted
):
    """At dp 2 the two ranks hold the same weights and moments, and the checkpoint holds one copy:
    each rank writes half of their cells (Megatron's fully parallel save, the default), or the first
    all of them with --no-ckpt-fully-parallel-save. Resuming in the same layout and at tp 2 reads
    them wherever they are."""
    sizes = {}
    for name, flags in (("parallel", []), ("first", ["--no-ckpt-fully-parallel-save"])):
        ckpt = tmp_path / name
        run_layout(
            tmp_path,
            f"dp2_{name}",
            2,
            [*flags, "--save", str(ckpt), "--train-iters", "10", "--lr-decay-iters", "20"],
        )
        directory = checkpoint.latest(ckpt)
        sizes[name] = [(directory / f"rank_0000{r}.safetensors").stat().st_size for r in (0, 1)]
    single = tmp_path / "single"
    run_layout(
        tmp_path, "one", 1, ["--save", str(single), "--train-iters", "10", "--lr-decay-iters", "20"]
    )
    one_copy = (checkpoint.latest(single) / "rank_00000.safetensors").stat().st_size
    assert sizes["first"][1] < 1000 and abs(sum(sizes["first"]) - one_copy) < 0.01 * one_copy, (
        sizes,
        one_copy,
    )
    assert all(abs(s - one_copy / 2) < 0.2 * one_copy for s in sizes["parallel"]), (sizes, one_copy)
    same = run_layout(tmp_path, "dp2_resumed", 2, ["--load", str(tmp_path / "parallel")])
    other = run_layout(
        tmp_path,
        "tp2_resumed",
        2,
        ["--tensor-model-parallel-size", "2", "--load", str(tmp_path / "first")],
    )
    for got in (same, other):
        assert len(got) == 10 and all(
            abs(a - b) <= 1e-5 * b for a, b in zip(got, uninterrupted[10:])
        )
