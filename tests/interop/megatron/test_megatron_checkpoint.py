"""Megatron-LM torch_dist checkpoints, written by megatron-core itself (its GPTModel's
sharded_state_dict() and dist_checkpointing.save, on CPU with gloo:
tests/harness/megatron_core_run.py), load into fmeg at any layout: the same logits as
megatron-core's model loaded from the same files, the same weights at every fmeg layout, and
training goes on from Megatron's iteration. Hostile or damaged files are refused in one line."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")

from fmeg.checkpoint import CheckpointError, latest  # noqa: E402
from fmeg.interop.megatron import MegatronCheckpoint  # noqa: E402
from fmeg.models import gpt  # noqa: E402
from fmeg.training.checkpoint_state import read_params  # noqa: E402
from fmeg.parallel.layout import Layout  # noqa: E402
from fmeg.training.parallel_step import shard_params  # noqa: E402
from fmeg import tree  # noqa: E402
from harness.runner import Server, run_group  # noqa: E402
from harness.checkpoints import mesh_of  # noqa: E402
from harness.megatron_families import CONFIGS, LLAMA  # noqa: E402
from harness.paths import TESTS

PROGRAM = str(TESTS / "harness" / "megatron_core_run.py")
FLAGS = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "96",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--rotary-base",
    "10000",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "127",
    "--make-vocab-size-divisible-by",
    "128",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "8",
    "--lr",
    "1e-3",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--log-interval",
    "100",
]
_SAVED: dict = {}


def megatron_checkpoint(
    tmp_path_factory, family: str, tp: int = 1, pp: int = 1, ep: int = 1
) -> Path:
    """A checkpoint megatron-core saved at iteration 3 (once per session): the directory --load
    takes."""
    key = (family, tp, pp, ep)
    if key not in _SAVED:
        root = tmp_path_factory.mktemp(f"megatron_{family}_tp{tp}_pp{pp}_ep{ep}")
        nproc = tp * pp * ep  # data parallelism of ep: the experts' ranks
        out = run_group(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                PROGRAM,
                "save",
                str(root),
                family,
                str(tp),
                str(pp),
                str(ep),
                "3",
            ],
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        _SAVED[key] = root
    return _SAVED[key]


def megatron_logits(
    directory: Path, family: str, tokens: torch.Tensor, tmp_path: Path
) -> torch.Tensor:
    torch.save(tokens, tmp_path / "tokens.pt")
    out = run_group(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            PROGRAM,
            "logits",
            str(directory),
            family,
            str(tmp_path / "tokens.pt"),
            str(tmp_path / "logits.pt"),
        ]
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp_path / "logits.pt", weights_only=True)


def one_device_params(root: Path, config: gpt.GPTConfig) -> dict:
    with MegatronCheckpoint.open(latest(root), config) as ckpt:
        ckpt.check(config)
        return read_params(ckpt, config, Layout(), mesh_of(Layout(), 0))[0]


@pytest.mark.parametrize(
    "family, tp, pp, ep",
    [
        ("llama", 2, 1, 1),
        pytest.param("llama", 1, 2, 1, marks=pytest.mark.slow),
        pytest.param("qwen3_moe", 1, 2, 2, marks=pytest.mark.slow),
        pytest.param("gpt2", 2, 1, 1, marks=pytest.mark.slow),
        ("gpt2_moe", 1, 1, 2),
    ],
)
def test_fmeg_gives_megatron_cores_logits_from_its_checkpoint(
    tmp_path_factory, tmp_path, family, tp, pp, ep
):
    """Llama-style (GQA, SwiGLU, RoPE, untied), MoE (Qwen3-MoE-style: q/k norm, sigmoid router with
    expert bias, a shared expert; and GPT-2-style with Megatron's default --add-bias-linear: a bias
    on the router and the experts) and GPT-2-style (LayerNorm with biases, GELU, learned positions,
    tied) models saved at Megatron's tp / pp / ep; megatron-core's logits come from its own
    dist_checkpointing.load of the files."""
    root, config = megatron_checkpoint(tmp_path_factory, family, tp, pp, ep), CONFIGS[family]
    tokens = torch.randint(0, 127, (2, 24), generator=torch.Generator().manual_seed(0))
    # less padding
    theirs = megatron_logits(latest(root), family, tokens, tmp_path)[..., : config.vocab_size]
    ours = gpt.apply(one_device_params(root, config), tokens, config)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize(
    "family, saved, layouts",
    [
        ("llama", (2, 1, 1), [Layout(tp=2), Layout(pp=2), Layout(tp=2, pp=2, chunks=2)]),
        pytest.param(
            "qwen3_moe",
            (1, 2, 2),
            [
                Layout(dp=4, ep=4),
                Layout(tp=2, dp=2, ep=2),
                Layout(pp=2, dp=2, ep=2),
                Layout(cp=2, ep=2),
            ],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_every_fmeg_layout_reads_the_weights_one_device_reads(
    tmp_path_factory, family, saved, layouts
):
    """Each rank of tp 2, pp 2 (virtual stages too), ep and cp reads exactly its shard of what one
    device reads, from a checkpoint Megatron saved at another layout."""
    root, config = megatron_checkpoint(tmp_path_factory, family, *saved), CONFIGS[family]
    whole = one_device_params(root, config)
    for layout in layouts:
        world = layout.tp * layout.pp * layout.cp * layout.dp
        from fmeg.data.tokenizers import padded_vocab_size

        c = config.replace(padded_vocab_size=padded_vocab_size(config.vocab_size, layout.tp, 128))
        padded = gpt.repad_vocab(whole, config, c.padded_vocab_size)
        for rank in range(world):
            mesh = mesh_of(layout, rank)
            want = shard_params(padded, c, layout, mesh)
            with MegatronCheckpoint.open(latest(root), c) as ckpt:
                got = read_params(ckpt, c, layout, mesh)
            for stage in want:
                for (path, a), (_, b) in zip(tree.items(got[stage]), tree.items(want[stage])):
                    assert torch.equal(a, b), (layout, rank, path)


def _curve(tmp_path, name: str, nproc: int, flags: list[str]) -> tuple[list[float], str]:
    import json

    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    out = run_group(
        launcher + ["-m", "recipes.gpt_pretrain", *FLAGS, "--log-dir", str(tmp_path / name), *flags]
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = [
        json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    ]
    return [(r["iteration"], r["lm_loss"]) for r in records if "lm_loss" in r], out.stdout


def test_training_goes_on_from_a_megatron_checkpoint_at_another_layout(tmp_path_factory, tmp_path):
    """`--load DIR` of Megatron's directory, nothing else changed: iteration 4 onwards from
    Megatron's iteration 3 and samples, the same curve at one rank and at tp 2 (fp32), the optimizer
    fresh with one warning line."""
    root = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    one, said = _curve(tmp_path, "one", 1, ["--load", str(root)])
    two, _ = _curve(tmp_path, "tp2", 2, ["--load", str(root), "--tensor-model-parallel-size", "2"])
    assert "a Megatron torch_dist checkpoint (tp 2, pp 1, ep 1) (iteration 3, 24 samples" in said
    assert "the checkpoint holds no optimizer state fmeg reads" in said
    assert [i for i, _ in one] == [4, 5, 6, 7, 8] and [i for i, _ in two] == [4, 5, 6, 7, 8]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(b), (one, two)
    assert one[-1][1] < one[0][1]  # it learns


def _refused(tmp_path, root: Path, flags: list[str] = ()) -> str:
    out = run_group(
        [
            sys.executable,
            "-m",
            "recipes.gpt_pretrain",
            *FLAGS,
            "--log-dir",
            str(tmp_path / "log"),
            "--load",
            str(root),
            *flags,
        ]
    )
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    return lines[0]


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_megatron_lms_own_args_are_read_as_inert_records(tmp_path_factory):
    """common.pt as Megatron-LM main writes it: its parser's Namespace
    (tests/fixtures/megatron_args) holds signal.Signals, megatron-core's enums and torch dtypes;
    each class is an inert stand-in, the fields kept."""
    from fmeg.interop.megatron import saved_args
    from fmeg.interop.megatron.safe_pickle import MegatronValue

    args = saved_args(latest(megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)))
    assert (
        isinstance(args.exit_signal, MegatronValue)
        and args.exit_signal.qualified == "signal.Signals"
    )
    assert args.exit_signal.args == (15,)
    assert args.attention_backend.qualified == "megatron.core.transformer.enums.AttnBackend"
    assert (
        args.params_dtype is torch.bfloat16
        and args.num_layers == 4
        and args.tensor_model_parallel_size == 2
    )
    assert len(vars(args)) > 800  # every dest of Megatron-LM's parser


def _plain_args(root: Path):
    """The args of a checkpoint under root less its inert records, to be pickled again."""
    import argparse

    from fmeg.interop.megatron import saved_args
    from fmeg.interop.megatron.safe_pickle import MegatronValue

    args = vars(saved_args(latest(root)))
    return argparse.Namespace(**{k: v for k, v in args.items() if not isinstance(v, MegatronValue)})


def test_crafted_pickles_run_nothing(tmp_path_factory, tmp_path):
    """os.system named anywhere in common.pt is an inert record: as its args the file is refused in
    one line, inside the args it loads and runs nothing; .metadata's allowlist refuses it."""
    from fmeg.interop.megatron import saved_args

    source = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    marker = tmp_path / "ran"
    common = tmp_path / "common"
    shutil.copytree(source, common)
    args = _plain_args(source)
    torch.save({"args": _RunsCode(marker), "iteration": 3}, latest(common) / "common.pt")
    assert "its args are posix.system(" in _refused(tmp_path, common)
    args.exit_signal, args.hook = _RunsCode(marker), [_RunsCode(marker)]
    torch.save(
        {"args": args, "iteration": 3, "hook": _RunsCode(marker)}, latest(common) / "common.pt"
    )
    assert saved_args(latest(common)).hook[0].qualified == "posix.system"
    metadata = tmp_path / "metadata"
    shutil.copytree(source, metadata)
    # a hand-written protocol-0 pickle: os.system("touch <marker>")
    (latest(metadata) / ".metadata").write_bytes(
        f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode()
    )
    assert ".metadata: refused, it names posix.system" in _refused(tmp_path, metadata)
    assert not marker.exists()


def test_a_string_where_megatron_writes_a_number_is_named(tmp_path_factory, tmp_path):
    source = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    args = _plain_args(source)
    args.num_layers = "4"
    torch.save({"args": args, "iteration": 3}, latest(damaged) / "common.pt")
    assert "args.num_layers is the str '4' where Megatron writes a number" in _refused(
        tmp_path, damaged
    )


def test_damaged_files_and_another_model_are_one_line_naming_them(tmp_path_factory, tmp_path):
    source = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    missing = tmp_path / "missing"
    shutil.copytree(source, missing)
    (latest(missing) / ".metadata").unlink()
    assert ".metadata: missing" in _refused(tmp_path, missing)
    truncated = tmp_path / "truncated"
    shutil.copytree(source, truncated)
    shard = max(latest(truncated).glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert f"{shard.name}: ends at byte" in _refused(tmp_path, truncated)
    line = _refused(tmp_path, source, ["--num-layers", "2"])
    assert "--num-layers 4 there, 2 in the flags" in line


def test_release_tracker_and_legacy_format_are_understood(tmp_path_factory, tmp_path):
    """Megatron's converters write 'release' in the tracker file; mp_rank_* directories without
    their files are an incomplete --ckpt-format torch checkpoint, named so in one line."""
    source = latest(megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1))
    release = tmp_path / "release_root"
    shutil.copytree(source, release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release")
    assert latest(release) == release / "release"
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (legacy / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(CheckpointError, match="an incomplete Megatron --ckpt-format torch"):
        latest(legacy)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist directory, whole, as fmeg's reader reads it."""
    from fmeg.checkpoint.boxes import Box
    from fmeg.interop.megatron.torch_dist import TorchDistDir

    d = TorchDistDir(directory)
    out = {}
    for key, (shape, dtype) in d.tensors.items():
        out[key] = torch.empty(shape, dtype=dtype)
        d.read([(key, Box((0,) * len(shape), shape), out[key])])
    return out


def _convert(*argv: str) -> None:
    from recipes.convert_checkpoint import main

    assert main(list(argv)) == 0


@pytest.mark.parametrize(
    "family, saved",
    [
        ("llama", (2, 1, 1)),
        pytest.param("qwen3_moe", (1, 2, 2), marks=pytest.mark.slow),
        pytest.param("gpt2", (2, 1, 1), marks=pytest.mark.slow),
        pytest.param("gpt2_moe", (1, 1, 2), marks=pytest.mark.slow),
    ],
)
def test_megatron_to_fmeg_to_megatron_is_bitwise(tmp_path_factory, tmp_path, family, saved):
    """import-megatron (the model from the checkpoint's args, its iteration and samples kept), then
    export-megatron: every tensor megatron-core wrote comes back bit for bit, and megatron-core's
    own load of the export gives the logits of its load of the original, bit for bit."""
    root = megatron_checkpoint(tmp_path_factory, family, *saved)
    _convert(
        "import-megatron",
        "--input",
        str(root),
        "--save",
        str(tmp_path / "fmeg"),
        "--vocab-size",
        "128",
    )
    from fmeg.checkpoint import Checkpoint

    with Checkpoint.open(latest(tmp_path / "fmeg")) as ckpt:
        assert (ckpt.meta["iteration"], ckpt.meta["consumed_samples"]) == (3, 24)
        assert gpt.GPTConfig(**ckpt.meta["model"]) == CONFIGS[family].replace(
            vocab_size=128, init_std=0.05
        )
    _convert("export-megatron", "--load", str(tmp_path / "fmeg"), "--save", str(tmp_path / "back"))
    from recipes.convert_checkpoint import main

    assert (
        main(
            ["export-megatron", "--load", str(tmp_path / "fmeg"), "--save", str(tmp_path / "back")]
        )
        == 2
    )
    theirs, ours = _tensors(latest(root)), _tensors(latest(tmp_path / "back"))
    for key, t in theirs.items():
        assert torch.equal(ours[key], t), key
    # a MoE norm's other spec's name
    assert all("pre_mlp_layernorm" in key for key in set(ours) - set(theirs))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = megatron_logits(latest(root), family, tokens, tmp_path / "a")
    after = megatron_logits(latest(tmp_path / "back"), family, tokens, tmp_path / "b")
    assert torch.equal(before, after)


def test_fmegs_checkpoint_exported_gives_megatron_cores_logits(tmp_path):
    """A checkpoint fmeg trained (8 iterations, default flags: one rank, fp32), exported for
    Megatron at tp 1: megatron-core's GPTModel loaded from it with dist_checkpointing.load gives
    fmeg's logits (1e-5)."""
    _curve(tmp_path, "train", 1, ["--save", str(tmp_path / "ckpt"), "--save-interval", "8"])
    _convert(
        "export-megatron", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "megatron")
    )
    from fmeg.interop.megatron import saved_args

    args = saved_args(latest(tmp_path / "megatron"))
    assert (args.iteration, args.consumed_train_samples, args.padded_vocab_size) == (8, 64, 128)
    from recipes.convert_checkpoint import load_full

    config, params = load_full(str(tmp_path / "ckpt"))
    tokens = torch.randint(0, 127, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = megatron_logits(latest(tmp_path / "megatron"), "llama", tokens, tmp_path)[..., :127]
    ours = gpt.apply(params, tokens, config)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


def test_an_exports_args_give_back_its_model():
    """model_args: the args an export writes, read as Megatron's flags, are the model that wrote
    them."""
    from fmeg.interop.megatron.model_args import args_for
    from fmeg.config.checkpoint_args import megatron_model

    for config in [
        *CONFIGS.values(),
        LLAMA.replace(rope_scaling=(8.0, 1.0, 4.0, 8192), qkv_bias=True),
        CONFIGS["gpt2"].replace(activation="gelu_tanh"),
        LLAMA.replace(bias=True, activation="gelu_tanh"),
        CONFIGS["qwen3_moe"].replace(
            moe_router_topk_scaling_factor=2.5,
            moe_shared_expert_gate=True,
            moe_aux_loss_coeff=1e-2,
            moe_router_topk=1,
        ),
    ]:
        for tp in (1, 2, 8):
            back = megatron_model(args_for(config, tp=tp), config.vocab_size)
            assert back == config.replace(padded_vocab_size=back.padded_vocab_size), (config, back)


@pytest.mark.parametrize("tp", [1, 2])
def test_generate_and_serve_give_megatron_cores_logprobs(tmp_path_factory, tmp_path, tp):
    """recipes.generate and recipes.serve --load of Megatron's directory (the model from
    Megatron-LM's own args) at tp 1 and tp 2: the greedy tokens are the argmax of megatron-core's
    logits for the text so far, and their logprobs, and the served prompt's (Megatron's scoring
    request), are megatron-core's to 1e-5."""
    import json

    root = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    prompt = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(3))
    # the args' --vocab-size: 127 ids
    flags = [
        "--load",
        str(root),
        "--tensor-model-parallel-size",
        str(tp),
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "127",
        "--device",
        "cpu",
    ]
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"] if tp > 1 else []
    )
    text = " ".join(map(str, prompt[0].tolist()))
    out = run_group(
        [
            sys.executable,
            *launcher,
            "-m",
            "recipes.generate",
            *flags,
            "--prompt",
            text,
            "--tokens",
            "4",
            "--top-k",
            "1",
            "--ignore-eod",
            "--json",
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    whole = torch.cat([prompt, torch.tensor([answer["tokens"]])], dim=1)
    # less the padded row
    logits = megatron_logits(latest(root), "llama", whole, tmp_path)[0, :, :127]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    want = logprobs[:-1].gather(1, whole[0, 1:, None])[:, 0]
    assert answer["tokens"] == logprobs[11:-1].argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor(answer["logprobs"][-4:], dtype=torch.float64), want[-4:], rtol=0, atol=1e-5
    )
    server = Server(str(root), nproc=tp, extra=flags[2:])
    try:
        status, body = server.request(
            "PUT", "/api", {"prompts": [text], "tokens_to_generate": 0, "logprobs": True}
        )
    finally:
        server.stop()
    assert status == 200, body
    torch.testing.assert_close(
        torch.tensor(json.loads(body)["logprobs"][0], dtype=torch.float64),
        want[:11],
        rtol=0,
        atol=1e-5,
    )


def test_use_checkpoint_args_reads_a_megatron_directorys_args(tmp_path_factory, tmp_path):
    """--use-checkpoint-args with --load of Megatron's directory: the model comes from Megatron-LM's
    own args in its common.pt (no model flag given), and training goes on from its iteration at tp
    2."""
    root = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    model = {
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--group-query-attention",
        "--num-query-groups",
        "--ffn-hidden-size",
        "--normalization",
        "--swiglu",
        "--position-embedding-type",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--rotary-base",
    }
    flags, skip = [], 0
    # FLAGS less the model's: each of those flags and its value, if any
    for i, flag in enumerate(FLAGS):
        if skip:
            skip -= 1
        elif flag in model:
            skip = int(i + 1 < len(FLAGS) and not FLAGS[i + 1].startswith("--"))
        else:
            flags.append(flag)
    out = run_group(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "recipes.gpt_pretrain",
            *flags,
            "--log-dir",
            str(tmp_path / "log"),
            "--load",
            str(root),
            "--use-checkpoint-args",
            "--tensor-model-parallel-size",
            "2",
        ]
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "(iteration 3, 24 samples" in out.stdout
    one, _ = _curve(tmp_path, "one", 1, ["--load", str(root)])
    import json

    records = [
        json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()
    ]
    two = [(r["iteration"], r["lm_loss"]) for r in records if "lm_loss" in r]
    assert [i for i, _ in two] == [4, 5, 6, 7, 8]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(b), (one, two)


def test_use_checkpoint_args_takes_megatrons_seq_length_unless_given(tmp_path_factory):
    """Megatron's load_args_from_checkpoint sets seq_length from the checkpoint's args when
    --seq-length is not given, as it sets max_position_embeddings (issue 67: fmeg's default 128 was
    refused against the checkpoint's 32 positions)."""
    from fmeg.config.arguments import parse_args
    from fmeg.config.validation import validate

    root = megatron_checkpoint(tmp_path_factory, "llama", 2, 1, 1)
    flags = ["--load", str(root), "--use-checkpoint-args", "--mock-data"]
    flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]
    a = parse_args(flags, world_size=1)
    assert (a.seq_length, a.max_position_embeddings) == (32, 32)
    assert validate(a, world_size=1) == []
    assert parse_args([*flags, "--seq-length", "16"], world_size=1).seq_length == 16


def test_the_dest_kinds_checked_on_reading_are_the_parsers():
    """model_args.damaged_dest keeps its own table of what Megatron writes for each model dest
    (interop sits below the flags); it agrees with the parser's switches and numbers."""
    from fmeg.interop.megatron import model_args
    from fmeg.config.arguments import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    for dest in model_args.MODEL_DESTS:
        action = actions[dest]
        switch, number = action.nargs == 0, action.type in (int, float) and action.nargs is None
        assert (dest in model_args._SWITCHES) == switch, dest
        assert (dest not in model_args._SWITCHES | model_args._UNCHECKED) == number, dest
