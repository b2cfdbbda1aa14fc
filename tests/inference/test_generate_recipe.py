"""recipes.generate as users run it: from a trained checkpoint, at any layout, with one-line
errors."""

import json
import subprocess
import sys

import pytest

from fmeg.inference import SamplingParams, generate
from recipes.convert_checkpoint import load_full

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _run(args, nproc=1, timeout=400):  # sized for a loaded 2-core machine
    launcher = TORCHRUN + [f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable]
    return subprocess.run(
        launcher + ["-m", "recipes.generate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _json_rows(out):
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


PROMPTS = ["--prompt", "import os\n", "--prompt", "def main("]


def test_greedy_text_is_the_models_greedy_continuation(trained_checkpoint):
    rows = _json_rows(
        _run(
            [
                "--load",
                trained_checkpoint,
                *PROMPTS,
                "--tokens",
                "24",
                "--temperature",
                "0",
                "--json",
                "--ignore-eod",
            ]
        )
    )
    config, params = load_full(trained_checkpoint)
    want = generate(
        params,
        [list(b"import os\n"), list(b"def main(")],
        config,
        max_new_tokens=24,
        sampling=SamplingParams(temperature=0.0),
    )
    assert [r["tokens"] for r in rows] == want.tokens
    assert rows[0]["text"] == bytes(t for t in want.tokens[0] if t < 256).decode(
        "utf-8", errors="replace"
    )
    assert all(r["finish_reason"] == "length" for r in rows)


def test_one_prompt_streams_its_text(trained_checkpoint):
    out = _run(
        [
            "--load",
            trained_checkpoint,
            "--prompt",
            "import sys",
            "--tokens",
            "16",
            "--temperature",
            "0",
            "--ignore-eod",
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _json_rows(
        _run(
            [
                "--load",
                trained_checkpoint,
                "--prompt",
                "import sys",
                "--tokens",
                "16",
                "--temperature",
                "0",
                "--json",
                "--ignore-eod",
            ]
        )
    )
    assert out.stdout == "import sys" + rows[0]["text"] + "\n"


@pytest.mark.parametrize(
    "nproc, layout",
    [(2, ["--tensor-model-parallel-size", "2"]), (2, ["--pipeline-model-parallel-size", "2"])],
    ids=["tp2", "pp2"],
)
def test_a_sampled_run_is_the_same_at_every_layout(trained_checkpoint, nproc, layout):
    args = [
        "--load",
        trained_checkpoint,
        *PROMPTS,
        "--tokens",
        "20",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--json",
    ]
    sharded, alone = _json_rows(_run(args + layout, nproc)), _json_rows(_run(args))
    assert [(r["text"], r["tokens"]) for r in sharded] == [(r["text"], r["tokens"]) for r in alone]
    for got, want in zip(sharded, alone):
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < 1e-5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tensor-model-parallel-size", "2"], "world size is 1"),
        (["--prompt", ""], "prompt 1 is empty"),
        (["--prompt", "x" * 70], "exceeds the model's 64 positions"),
        (["--tokens", "-1"], "--tokens must be >= 0"),
        (["--top-p", "1.5"], "--top-p must be at most 1"),
        (
            ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
            "checkpoint's vocabulary has 257 ids",
        ),
        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
        (["--top-p", "nan"], "--top-p must be a finite number, got nan"),
        (["--temperature", "inf"], "--temperature must be a finite number, got inf"),
        (["--seed", str(2**64)], "--seed must be an integer from 0 to 2**63 - 1"),
        (["--seed", "-3"], "--seed must be an integer from 0 to 2**63 - 1"),
    ]
    + (
        [(["--device", "cuda"], "--device cuda: torch.cuda.is_available() is False")]
        if not __import__("torch").cuda.is_available()
        else []
    ),
)
def test_bad_input_is_one_line_and_exit_2(trained_checkpoint, args, message):
    out = _run(["--load", trained_checkpoint, "--prompt", "x", *args])
    assert (
        out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    ), out.stderr


def test_a_missing_checkpoint_is_one_line(tmp_path):
    out = _run(["--load", str(tmp_path / "none"), "--prompt", "x"])
    assert out.returncode == 2 and "no such directory" in out.stderr
    out = _run(["--load", str(tmp_path), "--prompt", "x"])
    assert out.returncode == 2 and "not a checkpoint directory" in out.stderr
    (tmp_path / "a_file").write_text("")
    out = _run(["--load", str(tmp_path / "a_file"), "--prompt", "x"])
    assert out.returncode == 2 and "a_file: a file; name the checkpoint directory" in out.stderr


def test_a_checkpoint_from_a_newer_fmeg_is_one_line_naming_the_field(trained_checkpoint, tmp_path):
    import json
    import shutil

    from fmeg import checkpoint

    copy = tmp_path / "newer"
    shutil.copytree(trained_checkpoint, copy)
    latest = checkpoint.latest(copy)
    meta = json.loads((latest / "metadata.json").read_text())
    meta["model"]["attention_sink_count"] = 2
    (latest / "metadata.json").write_text(json.dumps(meta))
    out = _run(["--load", str(copy), "--prompt", "x"])
    lines = out.stderr.strip().splitlines()
    assert (
        out.returncode == 2
        and len(lines) == 1
        and "model fields this fmeg does not know (attention_sink_count)" in lines[0]
        and "upgrade fmeg" in lines[0]
    ), out.stderr


def test_streamed_text_ending_inside_a_character_keeps_its_bytes(
    trained_checkpoint, monkeypatch, capsys
):
    """The CLI streams one prompt; a completion that ends after the first byte of a two-byte
    character prints it as the tokenizer decodes it (the --json text's way), instead of dropping
    it."""
    from fmeg.inference.generate import Step
    from recipes import generate as recipe

    real_load = recipe.load_model

    def load_model(a):
        model = real_load(a)
        tail = list("é".encode())[:1]  # the completion ends after the first byte of "é"
        steps = [Step([t], [-0.5], [None]) for t in list("caf".encode())] + [
            Step(tail, [-0.5], ["length"])
        ]
        model.stream = lambda prompts, **options: iter(steps)
        return model

    monkeypatch.setattr(recipe, "load_model", load_model)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert recipe.main(["--load", trained_checkpoint, "--prompt", "x", "--tokens", "4"]) == 0
    assert capsys.readouterr().out == "x" + bytes([*b"caf", 0xC3]).decode(errors="replace") + "\n"


def test_the_largest_seed_samples_on_every_prompt(trained_checkpoint):
    """Prompt i samples with --seed + i, which wraps within torch's int64 seeds (as recipes.serve
    does)."""
    out = _run(
        [
            "--load",
            trained_checkpoint,
            *PROMPTS,
            "--tokens",
            "3",
            "--seed",
            str(2**63 - 1),
            "--json",
        ]
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(_json_rows(out)) == 2
