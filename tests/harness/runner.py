"""Runs recipes.gpt_pretrain in a subprocess (torchrun for several ranks) and reads its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from fmeg.testing.processes import kill_tree, run_in_own_group
from fmeg.testing.warm_pool import WarmPool

COMMON = [
    "--train-iters",
    "20",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--log-interval",
    "100",
    "--lr-warmup-iters",
    "2",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
]
# The vocabulary is padded as Megatron pads it: 384 at tp 1, 512 at tp 2 and 4. "plain" curves
# switch dropout off; DROPOUT restores Megatron's default of 0.1 (test_gpt_pretrain checks that it
# is the default).
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


# the recipes the tests run most: imported once a pytest process, each run's ranks forked
WARM = WarmPool(preload=["recipes.gpt_pretrain", "recipes.generate", "recipes.convert_checkpoint"])
_WARM_MODULES = ("recipes.gpt_pretrain", "recipes.generate", "recipes.convert_checkpoint")


def run_group(
    argv: list[str], timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """fmeg.testing's run_in_own_group: on a timeout or any failure the whole process group
    (torchrun and its workers) is killed, so no worker outlives its test. The timeout is sized for
    a loaded 2-core machine; env: variables set beside this process's. `python -m recipe ...` and
    `python -m torch.distributed.run --standalone --nproc-per-node=N -m recipe ...` of the recipes
    above run on the warm pool (fmeg.testing.warm_pool: the same ranks, their imports paid once),
    compiled runs (--compile) excepted: their compilation dwarfs the imports, and inductor's
    compile workers are left to the process torchrun starts; tests of torchrun's or fmeg.launch's
    own behaviour start those themselves."""
    warm = _warm_form(argv) if env is None else None
    if warm is not None:
        module, args, nproc = warm
        return WARM.run(module, args, nproc, timeout)
    return run_in_own_group(argv, timeout, env)


def _warm_form(argv: list[str]) -> tuple[str, list[str], int] | None:
    """(module, its arguments, ranks) of a command the warm pool runs as given, else None."""
    if not argv or argv[0] != sys.executable:
        return None
    rest, nproc = list(argv[1:]), 1
    torchrun = ["-m", "torch.distributed.run", "--standalone"]
    if rest[:3] == torchrun and len(rest) > 3 and rest[3].startswith("--nproc-per-node="):
        nproc, rest = int(rest[3].split("=", 1)[1]), rest[4:]
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in _WARM_MODULES and "--compile" not in rest:
        return rest[1], rest[2:], nproc
    return None


def run_recipe(
    tmp_path, name, nproc, flags, common=COMMON, not_on_stderr=()
) -> tuple[list[dict], str]:
    """(metrics.jsonl records, stdout) of common + flags on nproc ranks; not_on_stderr: texts the
    run must not print there (warnings it should not give)."""
    log_dir = tmp_path / name
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    out = run_group(
        launcher + ["-m", "recipes.gpt_pretrain", *common, "--log-dir", str(log_dir), *flags]
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert not [text for text in not_on_stderr if text in out.stderr], out.stderr[-4000:]
    return [
        json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()
    ], out.stdout


def run_layout(tmp_path, name, nproc, flags, not_on_stderr=()):
    """The lm_loss of each training iteration."""
    records, _ = run_recipe(tmp_path, name, nproc, flags, not_on_stderr=not_on_stderr)
    return [r["lm_loss"] for r in records if "lm_loss" in r]


def assert_same_curve(got, want):
    assert len(got) == len(want) == 20
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def sentencepiece_model(directory, vocab_size: int = 60) -> str:
    """A tiny sentencepiece BPE model (ids: unk 0, BOS 1, EOS 2) trained on a few lines, for
    Llama2Tokenizer."""
    import sentencepiece

    text = directory / "sentencepiece_text.txt"
    text.write_text(
        "\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200))
    )
    sentencepiece.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(directory / "tok"),
        vocab_size=vocab_size,
        model_type="bpe",
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
    )
    return str(directory / "tok.model")


def tiktoken_vocabulary(
    directory, merges=("th", "he", "the", " t", " the", "qu", "ick", "ck", "ic")
) -> str:
    """A tiny tiktoken JSON vocabulary (Megatron's TikTokenizer format): the 256 bytes, then a few
    merges."""
    import base64

    tokens = [bytes([i]) for i in range(256)] + [m.encode() for m in merges]
    path = directory / "tiktoken_vocab.json"
    path.write_text(
        json.dumps(
            [
                {
                    "rank": i,
                    "token_bytes": base64.b64encode(t).decode(),
                    "token_str": t.decode("latin-1"),
                }
                for i, t in enumerate(tokens)
            ]
        )
    )
    return str(path)


def small_checkpoint(directory) -> str:
    """A checkpoint of a 2-layer model trained for 30 iterations on the default data (byte
    vocabulary), for the generation and serving tests; written by the runner as users write it."""
    flags = [
        "--train-iters",
        "30",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--log-interval",
        "100",
        "--lr",
        "3e-3",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--save",
        str(directory),
    ]
    out = run_group([sys.executable, "-m", "recipes.gpt_pretrain", *flags])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return str(directory)


def assert_refused_in_one_line(
    monkeypatch, capsys, env: dict, flags: list[str], needle: str
) -> None:
    """gpt_pretrain.main(flags) on rank 0 of env's world exits 2 with one 'error: ' line holding
    needle, before any process group starts."""
    import torch.distributed as dist

    from recipes import gpt_pretrain

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RANK", "0")
    assert gpt_pretrain.main(flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not dist.is_initialized()


def greedy_at_tp1_and_tp2(
    hf_directory, tmp_path, prompt: str, tokens: int, vocab_size: int
) -> list[list[int]]:
    """recipes.convert_checkpoint import-hf of a transformers directory, then recipes.generate
    greedy on one rank and at tp 2 (torchrun): the generated ids of each run."""
    out = run_group(
        [
            sys.executable,
            "-m",
            "recipes.convert_checkpoint",
            "import-hf",
            "--input",
            str(hf_directory),
            "--save",
            str(tmp_path / "ckpt"),
        ],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    args = [
        "-m",
        "recipes.generate",
        "--load",
        str(tmp_path / "ckpt"),
        "--prompt",
        prompt,
        "--tokens",
        str(tokens),
        "--temperature",
        "0",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(vocab_size),
        "--json",
    ]
    rows = []
    for launcher in (
        [sys.executable],
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
    ):
        extra = ["--tensor-model-parallel-size", "2"] if len(launcher) > 1 else []
        out = run_group([*launcher, *args, *extra], timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        rows.append(
            [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")][0][
                "tokens"
            ]
        )
    return rows


def assert_same_logits_and_round_trip(hf, config, params, vocab_size: int, seed: int = 1) -> None:
    """fmeg's logits of an imported transformers model equal transformers' (fp32, 1e-5 of the
    largest), and the export is a model of the same class that imports back to the same config and
    the same tensors, bitwise."""
    import torch

    from fmeg import tree
    from fmeg.interop.hf import from_hf, to_hf
    from fmeg.models import gpt

    tokens = torch.randint(0, vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours, theirs = gpt.apply(params, tokens, config), hf(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())
    back = to_hf(params, config)
    assert type(back) is type(hf)
    config2, params2 = from_hf(back)
    flat, flat2 = tree.flatten(params), tree.flatten(params2)
    assert (
        config2 == config
        and flat.keys() == flat2.keys()
        and all(torch.equal(flat[k], flat2[k]) for k in flat)
    )


def greedy_tokens_of_both(
    hf, config, params, prompt: list[int], tokens: int = 12
) -> tuple[list[int], list[int]]:
    """(fmeg's greedy continuation of prompt by an imported model, transformers' own), tokens
    each."""
    import torch

    from fmeg.inference import SamplingParams, generate

    ours = generate(
        params, [prompt], config, max_new_tokens=tokens, sampling=SamplingParams(temperature=0.0)
    ).tokens[0]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)[
            0, len(prompt) :
        ].tolist()
    return ours, theirs


class Server:
    """recipes.serve on a free port of 127.0.0.1 (torchrun for several ranks), in a process group of
    its own."""

    def __init__(self, checkpoint, nproc=1, extra=(), launcher="torch.distributed.run"):
        from fmeg.parallel.spmd import free_port

        self.port = free_port()
        launcher = (
            [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}"]
            if nproc > 1
            else [sys.executable]
        )
        # stop() ends torchrun and its workers together
        self.proc = subprocess.Popen(
            launcher
            + ["-m", "recipes.serve", "--load", checkpoint, "--port", str(self.port), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.time() + 400  # a loaded 2-core machine starts torchrun and two ranks slowly
        while time.time() < deadline:  # the banner comes once the port is bound
            line = self.proc.stdout.readline()
            if "serving" in line:
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise AssertionError("the server did not start")

    def request(self, method, path, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(self.proc.pid)
        self.proc.wait()
