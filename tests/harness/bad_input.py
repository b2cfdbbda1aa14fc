"""Bad input as users give it: the one-line, exit-2, nothing-left-behind assertion, and the runner's
cases of bad flags, data and YAML files with the line each must print."""

from __future__ import annotations
import contextlib
import io
import os


T = "{tmp}"  # replaced by the case's own empty directory


def main_of(name: str):
    if name == "launch":
        from fmeg import launch

        return launch.main
    module = __import__(f"recipes.{name}", fromlist=["main"])
    return module.main


def assert_one_line_exit_2_nothing_left(
    tmp_path, monkeypatch, name: str, argv: list[str], needle: str
) -> None:
    """Run the command's main in this process (as rank 0 of 1, in tmp_path, {tmp} in argv replaced
    by it): exit 2, exactly one `error:` line holding needle, no traceback, and tmp_path as it
    was."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("FMEG_CACHE", str(tmp_path / ".cache"))
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main_of(name)([a.replace(T, str(tmp_path)) for a in argv])
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2, (code, lines)
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err.getvalue(), lines
    left = sorted(
        p.relative_to(tmp_path)
        for p in tmp_path.rglob("*")
        if not str(p).startswith(str(tmp_path / ".cache"))
    )
    assert left == [
        p for p in before if not str(tmp_path / p).startswith(str(tmp_path / ".cache"))
    ], set(left) ^ set(before)
    assert not os.environ.get("MASTER_ADDR") or name == "launch"


BAD = [
    (
        {"WORLD_SIZE": "4"},
        ["--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "96"],
        "--num-attention-heads 6 must be divisible by --tensor-model-parallel-size 4",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
        "--num-layers 3 must be divisible by --pipeline-model-parallel-size * virtual stages = 2 "
        "* 1",
    ),
    (
        {"WORLD_SIZE": "4"},
        [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers",
            "8",
            "--num-layers-per-virtual-pipeline-stage",
            "3",
        ],
        "must divide the 4 layers",
    ),
    (
        {"WORLD_SIZE": "4"},
        [
            "--tensor-model-parallel-size",
            "1",
            "--global-batch-size",
            "6",
            "--micro-batch-size",
            "4",
        ],
        "--global-batch-size 6 must be divisible by --micro-batch-size * data-parallel size = 4 * "
        "4",
    ),
    ({"WORLD_SIZE": "6"}, ["--tensor-model-parallel-size", "4"], "world size 6 must be divisible"),
    ({"WORLD_SIZE": "1"}, ["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive"),
    (
        {"WORLD_SIZE": "2"},
        ["--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"],
        "--num-query-groups 1 must be divisible by --tensor-model-parallel-size 2",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--group-query-attention", "--num-query-groups", "3"],
        "--num-query-groups 3 must divide --num-attention-heads 4",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--hidden-size", "30"],
        "--hidden-size 30 must be divisible by --num-attention-heads 4",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"],
        "--ffn-hidden-size 33 must be divisible",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--seq-length", "256", "--max-position-embeddings", "128"],
        "exceeds --max-position-embeddings",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--num-layers-per-virtual-pipeline-stage", "1"],
        "needs --pipeline-model-parallel-size > 1",
    ),
    ({"WORLD_SIZE": "1"}, ["--min-lr", "1.0"], "--min-lr 1.0 must be between 0 and --lr"),
    (
        {"WORLD_SIZE": "1"},
        ["--train-iters", "5", "--lr-warmup-iters", "10"],
        "--lr-warmup-iters 10 must be below",
    ),
    ({"WORLD_SIZE": "1"}, ["--micro-batch-size", "0"], "--micro-batch-size must be positive"),
    (
        {"WORLD_SIZE": "2"},
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--seq-length",
            "33",
            "--max-position-embeddings",
            "64",
        ],
        "--seq-length 33 must be divisible",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--data-path", "/nonexistent/corpus"],
        "--data-path /nonexistent/corpus: no",
    ),
    ({"WORLD_SIZE": "1"}, ["--split", "0,0,0"], "--split"),
    (
        {"WORLD_SIZE": "2"},
        ["--overlap-grad-reduce", "--ddp-bucket-size", "0"],
        "--ddp-bucket-size must be positive",
    ),
    ({"WORLD_SIZE": "1"}, ["--attention-dropout", "1.0"], "--attention-dropout must be in [0, 1)"),
    (
        {"WORLD_SIZE": "4"},
        [
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers",
            "8",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "4",
        ],
        "interleaved pipelining needs at least",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--split", "99999,1,0", "--eval-interval", "5"],
        "leaves the validation split",
    ),
    ({"WORLD_SIZE": "1"}, ["--adam-beta1", "2"], "--adam-beta1 must be in [0, 1), got 2.0"),
    ({"WORLD_SIZE": "1"}, ["--adam-eps=-1e-8"], "--adam-eps must be positive, got -1e-08"),
    ({"WORLD_SIZE": "1"}, ["--seed", "-5"], "--seed must be in [0, 2**63), got -5"),
    (
        {"WORLD_SIZE": "1"},
        ["--ffn-hidden-size", "-8"],
        "--ffn-hidden-size must be positive, got -8",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--global-batch-size", "0"],
        "--global-batch-size must be positive, got 0",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--no-position-embedding"],
        "--no-position-embedding without --position-embedding-type rope",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--lr-warmup-fraction", "1.5"],
        "--lr-warmup-fraction must be in [0, 1)",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8", "--lr-decay-samples", "80"],
        "--lr-warmup-samples and --lr-warmup-fraction are alternatives",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--lr-decay-samples", "80"],
        "--lr-decay-samples needs --lr-warmup-samples or",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--train-samples", "2"],
        "--train-samples 2 is less than one global batch",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--train-samples", "64", "--lr-warmup-samples", "64"],
        "the LR warmup of 64 samples must be below the decay's 64 samples",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--fp8-format", "hybrid", "--first-last-layers-bf16"],
        "--first-last-layers-bf16 with --fp8-recipe delayed: Megatron's delayed scaling does not",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"],
        "--fp8-amax-history-len must be at least 1, got 0",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--fp8-format", "hybrid", "--fp8-recipe", "custom"],
        "--fp8-recipe custom needs Transformer Engine's quantizer factory",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--tensor-model-parallel-size", "2"],
        "--fp8-recipe blockwise at --tensor-model-parallel-size 2: each rank's share of",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--num-experts", "4"]
        + ["--context-parallel-size", "2"],
        "--fp8-recipe mxfp8 with experts: at this layout one microbatch's rows for an expert",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--use-torch-fsdp2", "--use-megatron-fsdp"],
        "--use-megatron-fsdp and --use-torch-fsdp2 are two implementations of one thing; give one",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--outer-dp-sharding-strategy", "optim"],
        "--outer-dp-sharding-strategy optim: hybrid sharding is not supported by fmeg yet",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--use-torch-fsdp2", "--torch-fsdp2-reshard-after-forward", "4"],
        "--torch-fsdp2-reshard-after-forward 4: resharding to a smaller group after forward is "
        "not supported by fmeg yet",
    ),
    (
        {"WORLD_SIZE": "2"},
        [
            "--num-experts",
            "4",
            "--moe-token-dispatcher-type",
            "flex",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "--moe-token-dispatcher-type flex: fmeg's all-to-all moves tokens to experts that are not "
        "split over tp",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--num-distributed-optimizer-instances", "2"],
        "--num-distributed-optimizer-instances 2: replicas of a sharded state need one: add "
        "--use-distributed-optimizer",
    ),
    (
        {"WORLD_SIZE": "2"},
        ["--num-distributed-optimizer-instances", "3", "--use-distributed-optimizer"],
        "--num-distributed-optimizer-instances 3 must divide data x context parallel = 2 x 1",
    ),
    (
        {"WORLD_SIZE": "4"},
        [
            "--num-distributed-optimizer-instances",
            "2",
            "--use-distributed-optimizer",
            "--num-experts",
            "4",
            "--expert-model-parallel-size",
            "4",
        ],
        "--num-distributed-optimizer-instances 2 must divide the experts' data-parallel size 1",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--recompute-granularity", "full"],
        "--recompute-granularity full needs --recompute-method",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--recompute-method", "uniform"],
        "--recompute-method needs --recompute-granularity full",
    ),
    (
        {"WORLD_SIZE": "1"},
        ["--recompute-granularity", "selective", "--recompute-method", "block"],
        "--recompute-method applies to --recompute-granularity full, not selective",
    ),
    (
        {"WORLD_SIZE": "2"},
        [
            "--pipeline-model-parallel-size",
            "2",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "3",
        ],
        "--recompute-num-layers 3 must be between 1 and the 2 layers",
    ),
]


def _dataset(prefix, documents, *, extra_bin_bytes=0):
    import numpy as np

    from fmeg.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize()
    if extra_bin_bytes:
        with open(f"{prefix}.bin", "ab") as f:
            f.write(b"\0" * extra_bin_bytes)
    return str(prefix)


BAD_DATA = {  # name: (documents, bytes appended to the .bin, the error's words)
    "ids_past_vocab": (
        [[1, 2, 300] * 40] * 4,
        0,
        "big.bin: token id 300 is outside the tokenizer's vocabulary of 257",
    ),
    "stale_index": ([[1, 2, 3] * 40] * 4, 20, "describes only 960; the index is stale"),
    "empty": ([], 0, "the training split has no documents"),
    "too_short": ([[1, 2, 3]], 0, "--seq-length 16 is larger than the train split's 3 tokens"),
}


YAML_CASES = [
    ("fp16: 'no'\n", "fp16: 'no' is not true or false"),
    ("seed: 1.5\n", "seed: 1.5 is not an integer"),
    ("lr: null\n", "lr is null; give a value or leave the setting out"),
    ("num-layers: [1, 2]\n", "num-layers: expected one value, got [1, 2]"),
    ("lr-decay-style: spiral\n", "lr-decay-style: 'spiral' is not one of"),
    ("num-layers: 4\n  hidden-size: 8: 9\n", "not readable YAML"),
    ("lr: !!python/object/apply:os.system ['true']\n", "not readable YAML"),
    ("- 1\n- 2\n", "expected a mapping of flag names to values"),
    ("rampup-batch-size: [4, 4]\n", "rampup-batch-size: expected 3 values, got [4, 4]"),
]


def malformed_tokenizer_files(directory) -> list[tuple[list[str], str]]:
    """(flags, the error's words) naming tokenizer files that exist but cannot be read."""
    (directory / "bad.json").write_text('{"a": 1, bad')
    (directory / "merges.txt").write_text("#version: 0.2\nh e\n")
    (directory / "bad.model").write_bytes(b"garbage")
    return [
        (
            [
                "--vocab-file",
                str(directory / "bad.json"),
                "--merge-file",
                str(directory / "merges.txt"),
            ],
            "bad.json / --merge-file",
        ),
        (
            [
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                str(directory / "bad.json"),
            ],
            "bad.json: not a tokenizers-library file",
        ),
        (
            [
                "--tokenizer-type",
                "Llama2Tokenizer",
                "--tokenizer-model",
                str(directory / "bad.model"),
            ],
            "bad.model: not a sentencepiece model",
        ),
    ]
