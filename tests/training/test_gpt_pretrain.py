"""recipes.gpt_pretrain: bad arguments fail before any work with one line each; the loss curve does
not depend on the layout (tensor, sequence, pipeline with virtual stages, data parallel; dropout
included), with the layers compiled (--compile) or eager (the default on CPU)."""

import json
import os

import pytest
import torch.distributed as dist

from fmeg.config.arguments import parse_args
from fmeg.config.validation import validate
from recipes import gpt_pretrain
from harness.runner import (
    COMMON,
    DROPOUT,
    assert_refused_in_one_line,
    assert_same_curve,
    run_layout,
    run_recipe,
)
from harness.bad_input import BAD, BAD_DATA, YAML_CASES, _dataset, malformed_tokenizer_files


@pytest.mark.parametrize("env, flags, needle", BAD, ids=[b[2][:40] for b in BAD])
def test_bad_arguments_fail_before_any_work_with_one_line(monkeypatch, capsys, env, flags, needle):
    assert_refused_in_one_line(monkeypatch, capsys, env, flags, needle)


@pytest.mark.parametrize("name", list(BAD_DATA))
def test_bad_data_fails_before_any_work_with_one_line(monkeypatch, capsys, tmp_path, name):
    """Data the model cannot train on is refused before any process group or log exists: ids past
    the vocabulary (silently wrong under tensor parallelism otherwise), a .bin longer than its
    index, no documents, too few tokens for one sample."""
    documents, extra, needle = BAD_DATA[name]
    prefix = _dataset(
        tmp_path / ("big" if name == "ids_past_vocab" else name), documents, extra_bin_bytes=extra
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("FMEG_CACHE", str(tmp_path / "cache"))
    flags = [
        "--data-path",
        prefix,
        "--seq-length",
        "16",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--tensor-model-parallel-size",
        "2",
        "--log-dir",
        str(tmp_path / "log"),
    ]
    assert gpt_pretrain.main(flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not dist.is_initialized() and not (tmp_path / "log").exists()


def test_a_float_index_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    """An .idx that declares float values is not token ids (it used to be trained on as ids)."""
    import numpy as np

    from fmeg.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(tmp_path / "floats", np.float32)
    for _ in range(4):
        builder.add_document(np.arange(40, dtype=np.float32))
    builder.finalize()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("FMEG_CACHE", str(tmp_path / "cache"))
    assert gpt_pretrain.main(["--data-path", str(tmp_path / "floats"), "--seq-length", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "floats.idx declares float32 values, not integer token ids" in err[0]
    ), err


def test_a_bin_rewritten_in_place_with_its_size_and_mtime_is_counted_again(tmp_path):
    """The cache key holds the change time, which no user call sets back: ids past the vocabulary
    written into the same file, with its size and mtime restored, are found (they used to be trained
    on)."""
    import numpy as np

    from fmeg.data.indexed import IndexedDataset
    from fmeg.data.token_range import token_range

    prefix = _dataset(tmp_path / "d", [[5, 9, 7], [0, 3]])
    assert token_range(IndexedDataset(prefix), tmp_path / "cache") == (0, 9)
    stat = os.stat(prefix + ".bin")
    with open(prefix + ".bin", "r+b") as f:
        f.write(np.asarray([5, 900], dtype=np.uint16).tobytes())
    os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(prefix + ".bin").st_size == stat.st_size
    assert token_range(IndexedDataset(prefix), tmp_path / "cache") == (0, 900)


def test_token_range_is_cached_by_file_identity(tmp_path):
    from fmeg.data.indexed import IndexedDataset
    from fmeg.data.token_range import token_range

    prefix = _dataset(tmp_path / "d", [[5, 9, 7], [0, 3]])
    assert token_range(IndexedDataset(prefix), tmp_path / "cache") == (0, 9)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert token_range(IndexedDataset(prefix), tmp_path / "cache") == (0, 9)  # from the cache
    _dataset(tmp_path / "d", [[5, 19]])  # rewritten: another size, another entry
    assert token_range(IndexedDataset(prefix), tmp_path / "cache") == (5, 19)


@pytest.mark.parametrize(
    "argv, code, needle",
    [
        (["--help"], 0, "usage:"),
        (["--bogus"], 2, "error: unrecognized argument --bogus; see --help"),
    ],
)
def test_help_and_usage_errors_print_from_rank_zero_only(monkeypatch, capsys, argv, code, needle):
    for rank, prints in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == code
        out = capsys.readouterr()
        assert (needle in out.out + out.err) == prints, (rank, out)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--loss-scale-win", "8"],
            "unrecognized argument --loss-scale-win (did you mean --loss-scale-window?)",
        ),
        (["--fp1"], "unrecognized argument --fp1 (did you mean --fp16?)"),
        (
            ["--exit-sig", "SIGUSR1"],
            "unrecognized argument --exit-sig (did you mean --exit-signal?)",
        ),
        (
            ["--tensor-model-parallel", "2"],
            "unrecognized argument --tensor-model-parallel (did you mean "
            "--tensor-model-parallel-size?)",
        ),
    ],
)
def test_a_prefix_of_a_flag_is_refused_in_one_line_as_megatron_refuses_it(
    monkeypatch, capsys, argv, needle
):
    """Megatron's parser has allow_abbrev=False: a prefix is not its flag (argparse's default read
    --loss-scale 8192 as --loss-scale-window 8192). One line, no usage text, exit 2."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        stop.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0]
    ), err


def test_every_problem_is_reported_at_once():
    problems = validate(
        parse_args(
            ["--hidden-size", "30", "--fp16", "--bf16", "--min-lr", "9", "--clip-grad", "-1"]
        ),
        1,
    )
    assert len(problems) >= 4


def test_yaml_config_with_flags_overriding(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 6\nhidden_size: 96\nlr: 0.001\n")
    a = parse_args(["--config", str(cfg), "--hidden-size", "64"])
    assert (a.num_layers, a.hidden_size, a.lr) == (6, 64, 0.001)
    cfg.write_text("num-layerz: 6\n")
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])


RAMPUP = ["--rampup-batch-size", "4", "4", "40"]
# small buckets: several start during backward
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]
ZERO_OVERLAP = ["--use-distributed-optimizer", *OVERLAP]
VP2 = ["--num-layers-per-virtual-pipeline-stage", "1"]


def recompute(method, layers):
    return [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        method,
        "--recompute-num-layers",
        str(layers),
    ]


SMALL = [
    ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "plain"),
    (
        "pp2_vp2",
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        "plain",
    ),
    ("dp2_dropout_overlap", 2, [*DROPOUT, *OVERLAP], "dropout"),
    ("dp2_zero1", 2, ["--use-distributed-optimizer"], "plain"),
    ("recompute_uniform_dropout", 1, [*DROPOUT, *recompute("uniform", 1)], "dropout"),
]
# (the compiled row is slow: tests/parallel/test_compile.py keeps a compiled tp 2 + sp stage in the
# default suite)
FULL = [
    (
        "compiled_tp2_sp_dropout",
        2,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", *DROPOUT, "--compile"],
        "dropout",
    ),
    ("tp2", 2, ["--tensor-model-parallel-size", "2"], "plain"),
    ("tp4", 4, ["--tensor-model-parallel-size", "4"], "plain"),
    ("tp4_sp", 4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"], "plain"),
    (
        "tp4_pp2_sp",
        8,
        [
            "--tensor-model-parallel-size",
            "4",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "plain",
    ),
    ("pp2", 2, ["--pipeline-model-parallel-size", "2"], "plain"),
    ("dp2", 2, [], "plain"),
    ("dp2_zero1_overlap", 2, ZERO_OVERLAP, "plain"),
    (
        "tp2_pp2",
        4,
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        "plain",
    ),
    ("pp4", 4, ["--pipeline-model-parallel-size", "4"], "plain"),
    ("tp2_dp2", 4, ["--tensor-model-parallel-size", "2"], "plain"),
    ("pp2_dp2", 4, ["--pipeline-model-parallel-size", "2"], "plain"),
    (
        "pp2_zero_bubble",
        2,
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero_bubble"],
        "plain",
    ),
    ("tp2_dp2_dropout", 4, ["--tensor-model-parallel-size", "2", *DROPOUT], "dropout"),
    (
        "tp2_sp_pp2_dropout",
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--pipeline-model-parallel-size",
            "2",
            *DROPOUT,
        ],
        "dropout",
    ),
    (
        "tp2_dp2_zero1",
        4,
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
        "plain",
    ),
    (
        "pp2_dp2_zero1",
        4,
        ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
        "plain",
    ),
    (
        "pp2_vp2_dp2_zero1_overlap",
        4,
        ["--pipeline-model-parallel-size", "2", *VP2, *ZERO_OVERLAP],
        "plain",
    ),
    ("tp2_dp2_overlap", 4, ["--tensor-model-parallel-size", "2", *OVERLAP], "plain"),
    ("tp2_dp2_rampup", 4, ["--tensor-model-parallel-size", "2", *RAMPUP], "rampup"),
    (
        "pp2_vp2_recompute_block",
        2,
        ["--pipeline-model-parallel-size", "2", *VP2, *recompute("block", 1)],
        "plain",
    ),
    (
        "tp2_sp_recompute_uniform2_dropout",
        2,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            *DROPOUT,
            *recompute("uniform", 2),
        ],
        "dropout",
    ),
    (
        "tp2_recompute_selective_dropout",
        2,
        ["--tensor-model-parallel-size", "2", *DROPOUT, "--recompute-granularity", "selective"],
        "dropout",
    ),
]


@pytest.mark.parametrize("name, nproc, flags, ref", SMALL, ids=[s[0] for s in SMALL])
def test_layout_invariance(tmp_path, reference, name, nproc, flags, ref):
    # the distributed optimizer's collectives are torch's current ones: torch 2.13 warns on every
    # rank of all_gather_into_tensor and reduce_scatter_tensor
    quiet = ("FutureWarning",) if "--use-distributed-optimizer" in flags else ()
    assert_same_curve(run_layout(tmp_path, name, nproc, flags, quiet), reference[ref])


@pytest.mark.slow
@pytest.mark.parametrize("name, nproc, flags, ref", FULL, ids=[s[0] for s in FULL])
def test_layout_invariance_full_matrix(tmp_path, reference, name, nproc, flags, ref):
    if ref == "rampup" and "rampup" not in reference:
        reference["rampup"] = run_layout(tmp_path, "single_rampup", 1, RAMPUP)
    assert_same_curve(run_layout(tmp_path, name, nproc, flags), reference[ref])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, nproc, flags, ref",
    [s for s in SMALL + FULL if "--compile" not in s[2]],
    ids=[s[0] for s in SMALL + FULL if "--compile" not in s[2]],
)
def test_layout_invariance_compiled(tmp_path, reference, name, nproc, flags, ref):
    """Every layout with its layers compiled (inductor) against the eager single-rank reference."""
    if ref == "rampup" and "rampup" not in reference:
        reference["rampup"] = run_layout(tmp_path, "single_rampup", 1, RAMPUP)
    assert_same_curve(run_layout(tmp_path, name, nproc, [*flags, "--compile"]), reference[ref])


def test_validation_records_samples_schedule_and_loss_picture(tmp_path):
    run_layout(
        tmp_path,
        "eval",
        1,
        [
            "--eval-interval",
            "10",
            "--eval-iters",
            "1",
            "--lr-warmup-samples",
            "16",
            "--lr-decay-samples",
            "160",
            *RAMPUP,
        ],
    )
    records = [
        json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()
    ]
    valid = [r for r in records if "validation_lm_loss" in r]
    assert [r["iteration"] for r in valid] == [10, 20] and all(
        r["validation_lm_loss"] > 0 for r in valid
    )
    train = [r for r in records if "lm_loss" in r]
    # 4 until 40 samples, then 8
    assert [r["global_batch_size"] for r in train[:12]] == [4] * 10 + [8] * 2
    from fmeg.optim import LRSchedule

    schedule = LRSchedule(max_lr=3e-3, min_lr=0.0, warmup_steps=16, decay_steps=160, style="linear")
    consumed = 0
    for r in train:  # the schedule counts samples consumed before the step
        assert r["lr"] == pytest.approx(schedule(consumed))
        consumed += r["global_batch_size"]
        assert r["consumed_samples"] == consumed and r["timers_ms"]["forward-backward"] > 0
    assert (tmp_path / "eval" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_the_loss_falls_and_dropout_matters(reference):
    assert reference["plain"][-1] < reference["plain"][0] - 1.0
    assert max(abs(a - b) for a, b in zip(reference["plain"], reference["dropout"])) > 1e-3


def test_with_no_parallel_flags_every_rank_is_data_parallel_as_in_megatron():
    from fmeg.config.arguments import batch_geometry

    a = parse_args([], world_size=4)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (1, 1)
    assert batch_geometry(a, 4) == (4, 4 * a.micro_batch_size)


def test_train_samples_counts_the_run_and_its_schedule_in_samples(tmp_path, reference):
    """--train-samples 160 of global batches of 8 is the reference's 20 iterations, and its LR
    schedule in samples (warmup 16, decay over the 160) gives the same rates as the reference's 2
    and 20 iterations."""
    i = COMMON.index("--train-iters")
    common = COMMON[:i] + COMMON[i + 2 :]
    records, stdout = run_recipe(
        tmp_path,
        "samples",
        1,
        ["--train-samples", "160", "--lr-warmup-samples", "16", "--log-interval", "20"],
        common=common,
    )
    assert [r["lm_loss"] for r in records] == reference["plain"]
    assert records[-1]["consumed_samples"] == 160 and " iteration       20/      20 |" in stdout


def test_group_query_attention_switch_defaults_to_one_group_as_in_megatron():
    assert parse_args(["--group-query-attention"]).num_query_groups == 1
    assert parse_args(["--group-query-attention", "--num-query-groups", "2"]).num_query_groups == 2
    assert parse_args([]).num_query_groups is None  # multi-head attention
    alone = parse_args(["--num-query-groups", "2"])  # Megatron ignores it without the switch
    assert alone.num_query_groups is None and alone.notices == [
        "--num-query-groups 2 has no effect without --group-query-attention (as in Megatron): "
        "multi-head attention"
    ]


def test_weight_decay_increment_follows_its_schedule(tmp_path):
    run_layout(
        tmp_path,
        "wd",
        1,
        [
            "--start-weight-decay",
            "0.0",
            "--end-weight-decay",
            "0.1",
            "--weight-decay-incr-style",
            "cosine",
        ],
    )
    records = [
        json.loads(line) for line in (tmp_path / "wd" / "metrics.jsonl").read_text().splitlines()
    ]
    from fmeg.optim import WeightDecaySchedule

    schedule = WeightDecaySchedule(start=0.0, end=0.1, incr_steps=20, style="cosine")
    assert [r["weight_decay"] for r in records] == pytest.approx([schedule(i) for i in range(20)])


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_layout(
        tmp_path, "tb", 1, ["--tensorboard-dir", str(tmp_path / "tb_events"), "--train-iters", "5"]
    )
    events = EventAccumulator(str(tmp_path / "tb_events"))
    events.Reload()
    assert "lm loss" in events.Tags()["scalars"] and len(events.Scalars("lm loss")) == 5


MEGATRON_SCRIPT = [
    "--use-flash-attn",
    "--attention-softmax-in-fp32",
    "--no-masked-softmax-fusion",
    "--no-gradient-accumulation-fusion",
    "--transformer-impl",
    "local",
    "--use-mcore-models",
    "--distributed-backend",
    "nccl",
    "--num-workers",
    "2",
    "--log-params-norm",
    "--lr-warmup-fraction",
    "0.1",
    "--log-interval",
    "5",
]


@pytest.mark.slow  # the scripts run in tests/interop/megatron/test_megatron_scripts.py
def test_megatron_script_flags_run_unchanged_and_the_params_norm_is_layout_invariant(
    tmp_path, reference
):
    """Kernel and implementation flags from Megatron scripts are accepted, named once as ignored,
    and change nothing: with --lr-warmup-fraction 0.1 of 20 decay iterations (= the reference's 2
    warmup iterations), the curve is the reference's, bitwise. The params norm counts the tied
    output copy once (checked against the saved weights) and is the same under tp 2 x pp 2."""
    from safetensors.torch import load_file

    single, stdout = run_recipe(
        tmp_path, "script", 1, MEGATRON_SCRIPT + ["--save", str(tmp_path / "ck")]
    )
    assert [r["lm_loss"] for r in single] == reference["plain"]
    for flag in ("--use-flash-attn", "--transformer-impl", "--distributed-backend"):
        assert stdout.count(f"ignored {flag}: ") == 1
    assert stdout.count("| params norm: ") == 4  # log interval 5 of 20 iterations
    weights = load_file(next((tmp_path / "ck" / "iter_0000020").glob("rank_*.safetensors")))
    squares = sum(
        float(v.double().pow(2).sum()) for k, v in weights.items() if k.startswith("params/")
    )
    assert single[-1]["params_norm"] == pytest.approx(squares**0.5, rel=1e-12)
    tp2pp2, _ = run_recipe(
        tmp_path,
        "script_tp2pp2",
        4,
        MEGATRON_SCRIPT
        + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    )
    assert [r["params_norm"] for r in tp2pp2] == pytest.approx(
        [r["params_norm"] for r in single], rel=1e-6
    )


@pytest.mark.parametrize("text, needle", YAML_CASES, ids=[c[1][:30] for c in YAML_CASES])
def test_yaml_values_are_typed_as_their_flags_and_refused_in_one_line(
    tmp_path, capsys, text, needle
):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as stop:
        parse_args(["--config", str(cfg)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        stop.value.code == 2
        and len(err) == 1
        and err[0].startswith(f"error: --config {cfg}")
        and needle in err[0]
    )


def test_yaml_values_of_the_right_type_are_taken():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(
            "fp16: true\nseed: 7\nlr: 1\nmin-lr: '0.0001'\ndata-path: "
            "[corpus_a]\nrampup-batch-size: [4, 4, 40]\n"
        )
    a = parse_args(["--config", f.name])
    assert (a.fp16, a.seed, a.lr, a.min_lr, a.data_path, a.rampup_batch_size) == (
        True,
        7,
        1.0,
        1e-4,
        ["corpus_a"],
        [4, 4, 40],
    )


@pytest.mark.parametrize("flag", ["--save", "--log-dir", "--tensorboard-dir", "--data-cache-path"])
def test_an_output_directory_that_cannot_be_written_is_one_line_before_any_work(
    tmp_path, monkeypatch, capsys, flag
):
    """A file in the way (as the directory, or above it) and a directory the user cannot write (the
    check access(2) makes, which also sees read-only filesystems; simulated here, since root passes
    mode bits)."""
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("")
    monkeypatch.setenv("RANK", "0")
    for path, needle in (
        (in_the_way, "is a file, not a directory"),
        (in_the_way / "out", "a_file is a file, so no directory can be made under it"),
    ):
        assert gpt_pretrain.main([flag, str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1 and err[0].startswith(f"error: {flag} {path}: ") and needle in err[0]
        ), err
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(read_only) else real_access(p, mode)
    )
    assert gpt_pretrain.main([flag, str(read_only / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "read_only is not writable (cannot create it)" in err[0], err
    assert not dist.is_initialized()


def test_a_tokenizer_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sentencepiece")
    monkeypatch.setenv("RANK", "0")
    for flags, needle in malformed_tokenizer_files(tmp_path):
        assert gpt_pretrain.main(flags) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --") and needle in err[0], err


def test_a_yaml_infinity_is_refused_as_the_flag_is(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: .inf\nmin-lr: .nan\n")
    problems = validate(parse_args(["--config", str(cfg)]), 1)
    assert problems == [
        "--lr must be a finite number, got inf",
        "--min-lr must be a finite number, got nan",
    ]


OPEN_MODELS = [
    "--qk-layernorm",
    "--add-qkv-bias",
    "--disable-bias-linear",
    "--use-rope-scaling",
    "--rope-scaling-factor",
    "4",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--max-position-embeddings",
    "16",
]
OPEN_LAYOUTS = [
    ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
    ("dp2_zero1", 2, ["--use-distributed-optimizer"]),
]


@pytest.fixture(scope="module")
def open_model_reference(tmp_path_factory):
    return run_layout(tmp_path_factory.mktemp("open"), "single_open", 1, OPEN_MODELS)


@pytest.mark.parametrize(
    "name, nproc, flags",
    [
        pytest.param(*row, marks=() if row[0] == "tp2_sp" else pytest.mark.slow)
        for row in OPEN_LAYOUTS
    ],
    ids=[row[0] for row in OPEN_LAYOUTS],
)
def test_qk_norm_qkv_bias_and_rope_scaling_are_layout_invariant(
    tmp_path, open_model_reference, name, nproc, flags
):
    """Qwen3's q/k norm, Qwen2.5's q/k/v bias and Llama 3.1's RoPE scaling, at default flags
    otherwise: the curve at tp 2 with sp (the norm's replicated weight summed over tp), pp 2 and dp
    2 with ZeRO-1 is one rank's within 1e-5."""
    assert_same_curve(
        run_layout(tmp_path, name, nproc, [*OPEN_MODELS, *flags]), open_model_reference
    )
