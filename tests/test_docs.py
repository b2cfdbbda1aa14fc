"""The README's and docs/'s examples run as written: the Python examples, and every command of
their bash blocks except the set-up (`pip install`, which CI runs) and the test command itself.
Each block runs in a fresh directory, in order, through bash, exactly as a user would paste it. The
docs site builds with mkdocs --strict."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def test_the_readme_python_example_runs():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (4, 64, 256)
    assert 5.0 < namespace["metrics"]["loss"].item() < 6.0
    from fmeg import tree

    assert [p for p, _ in tree.items(namespace["grads"])] == [
        p for p, _ in tree.items(namespace["params"])
    ]


def bash_commands(text: str) -> list[str]:
    """The commands of text's ```bash blocks (continuation lines joined), set-up and test commands
    left out."""
    commands = []
    for body in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()]
        commands += [c for c in lines if not c.startswith("pip install") and "-m pytest" not in c]
    return commands


def section(heading: str) -> list[str]:
    """The commands under the README's '## heading'."""
    (body,) = [part for part in README.split("\n## ") if part.startswith(heading + "\n")]
    return bash_commands(body)


def page(name: str) -> list[str]:
    """The commands of docs/name."""
    return bash_commands(PAGES[name])


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def run_block(commands: list[str], cwd: Path) -> list[str]:
    """Each command's stdout; every command must exit 0."""
    outputs = []
    for command in commands:
        out = subprocess.run(
            ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, f"{command}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
        outputs.append(out.stdout)
    return outputs


def loss_fall(stdout: str) -> tuple[float, float]:
    first, last = re.search(r"lm loss (\d+\.\d+) -> (\d+\.\d+)", stdout).groups()
    return float(first), float(last)


def test_every_command_of_the_readme_and_docs_is_run_by_a_test():
    tested = (
        section("Train")
        + page("checkpoints.md")
        + page("models.md")
        + page("data.md")
        + page("experts.md")
        + page("long-sequences.md")
        + page("fine-tuning.md")
        + page("testing.md")
        + page("optimizers.md")
        + page("parallelism.md")
    )
    everything = bash_commands(README) + [c for text in PAGES.values() for c in bash_commands(text)]
    assert sorted(tested) == sorted(everything) and len(tested) == 30
    # several processes start under fmeg.launch, whose refusals are one line
    assert not [c for c in everything if c.startswith("torchrun")]
    # nothing recommends signalling runs by a name pattern, which reaches other users' runs
    assert not re.search(r"pkill|killall", README + "".join(PAGES.values()))


def test_the_readme_is_short_and_links_to_pages_that_exist():
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)]+)\)", README)
    assert len(links) >= 12 and all((ROOT / link).is_file() for link in links)
    assert {f"docs/{name}" for name in PAGES} - set(links) <= {"docs/index.md", "docs/api.md"}


def test_the_notebooks_cover_every_transform_and_are_stored_with_their_outputs():
    """The tests run each notebook (nbmake); here: there are the ones the docs name, each stored
    with the outputs a reader sees without running it, none of them an error."""
    import nbformat

    names = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(names) >= 6
    for name in names:
        assert f"notebooks/{name}.ipynb" in PAGES["index.md"] + README, name
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert outputs and not [o for o in outputs if o.output_type == "error"], name


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "check_sharded" in api and "column_parallel_linear" in api


def test_the_docs_python_example_runs():
    (code,) = python_blocks(PAGES["testing.md"])
    namespace: dict = {}
    exec(compile(code, "docs/testing.md", "exec"), namespace)
    assert {check for check, _ in namespace["checked"].compared} == {
        "forward", "grad", "vjp", "vmap"
    }  # fmt: skip


def test_the_generation_pages_openai_client_starts_without_an_openai_key(monkeypatch):
    """The page's client, as written, with no OPENAI_API_KEY set (openai refuses to build one
    without a key: "Missing credentials"); tests/inference/test_serve_chat.py talks to the server
    through the same client."""
    openai = pytest.importorskip("openai")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    (client,) = re.findall(r"`(openai\.OpenAI\(.*?\))\.chat", PAGES["generation.md"])
    made = eval(client, {"openai": openai})
    assert str(made.base_url).rstrip("/") == "http://127.0.0.1:5000/v1"


def test_the_deterministic_runs_of_the_docs_agree_bit_for_bit(tmp_path):
    commands = [c for c in page("testing.md") if "fmeg.check" not in c]
    assert len(commands) == 5 and all("--deterministic-mode" in c for c in commands[:3])
    *_, zero3, tp2 = run_block(commands, tmp_path)
    assert zero3.strip() == tp2.strip() == "bitwise"


# 25 s; tests/check/test_layout_check.py runs the same check in the default suite
@pytest.mark.slow
def test_the_layout_check_of_the_docs(tmp_path):
    (stdout,) = run_block([c for c in page("testing.md") if "fmeg.check" in c], tmp_path)
    rows = [line for line in stdout.splitlines() if line.endswith("same")]
    assert [row.split()[0] for row in rows] == ["tp2", "pp2-vp2", "dp2-zero"]
    assert "every layout equals one rank within 1e-05" in stdout


@pytest.mark.slow  # the runner's context-parallel layouts run in tests/layouts/test_cp_layouts.py
def test_docs_context_parallelism(tmp_path):
    (stdout,) = run_block(page("long-sequences.md"), tmp_path)
    assert "world 4 = tp 1 x pp 1 (x1 virtual) x dp 1 x cp 4 (p2p)" in stdout
    first, last = loss_fall(stdout)
    assert last < first


@pytest.mark.slow  # the runner's MoE layouts run in tests/layouts/test_moe_layouts.py
def test_docs_mixture_of_experts(tmp_path):
    (stdout,) = run_block(page("experts.md"), tmp_path)
    assert "| load_balancing_loss: " in stdout and "world 2 = tp 2" in stdout
    first, last = loss_fall(stdout)
    assert last < first - 1.5


@pytest.mark.slow  # the optimizers' layouts run in tests/layouts/test_optimizer_layouts.py
def test_docs_muon_run(tmp_path):
    (stdout,) = run_block(page("optimizers.md"), tmp_path)
    assert "optimizer muon (quintic x5, bf16, spectral; adam on the rest)" in stdout
    first, last = loss_fall(stdout)
    assert last < first - 1.0


@pytest.mark.slow  # uneven stages run in tests/layouts/test_pipeline_layouts.py
def test_docs_uneven_pipeline_stages(tmp_path):
    (stdout,) = run_block(page("parallelism.md"), tmp_path)
    assert "world 2 = tp 1 x pp 2 (x3 virtual) x dp 1, layers per stage 0|2|3|0|3|0;" in stdout
    assert "pipeline stages (per microbatch on one rank of each): layers 0|2|3|0|3|0;" in stdout
    first, last = loss_fall(stdout)
    assert last < first


def test_docs_main_job(tmp_path):
    (stdout,) = run_block(section("Train"), tmp_path)
    assert "world 4 = tp 2 x pp 2 (x1 virtual) x dp 1" in stdout
    first, last = loss_fall(stdout)
    assert first > 5.2 and last < 3.3  # from about ln 257 (the README says 5.4 to 3.0)


# 90 s; the main job runs in the default suite, resharding in tests/checkpoint/test_checkpoint.py
@pytest.mark.slow
def test_docs_checkpoints_save_resume_at_another_layout_and_export(tmp_path):
    save, resume, export, load, generated, sharded = run_block(page("checkpoints.md"), tmp_path)
    assert "exiting at iteration 40: --exit-interval 40" in save
    assert "resumed from ckpt/iter_0000040" in resume and "resharded from" in resume
    assert " iteration       60/      60 |" in resume
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "60"
    assert "wrote hf_model (GPT2LMHeadModel)" in export
    assert json.loads((tmp_path / "hf_model" / "config.json").read_text())["vocab_size"] == 257
    assert "GPT2LMHeadModel" in load
    (alone,), (two_ranks,) = (
        [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for out in (generated, sharded)
    )
    assert alone["tokens"] == two_ranks["tokens"] and len(alone["tokens"]) >= 1
    assert alone["text"] == two_ranks["text"] and alone["prompt"] == "import os"
    assert max(abs(a - b) for a, b in zip(alone["logprobs"], two_ranks["logprobs"])) < 1e-5


@pytest.mark.slow
def test_the_data_page_makes_its_corpus_preprocesses_it_and_trains(tmp_path):
    """Nothing comes from elsewhere: the page's first command writes the corpus."""
    _, preprocess, train = run_block(page("data.md"), tmp_path)
    assert (tmp_path / "data" / "corpus_text_document.idx").is_file()
    assert "0 bad lines skipped" in preprocess
    first, last = loss_fall(train)
    assert last < first - 2.0


@pytest.mark.slow
def test_docs_open_models(tmp_path):
    """A transformers Qwen3 imported, continued on the embedded data at tp 2, served and
    exported."""
    pytest.importorskip("transformers")
    _, _, train, generated, _ = run_block(page("models.md"), tmp_path)
    first, last = loss_fall(train)
    assert last < first - 1.0 and "fine-tuning from" in train
    assert generated.startswith("import os")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "qwen3_continued_hf"))
    assert type(model).__name__ == "Qwen3ForCausalLM"


@pytest.mark.slow  # 2 to 10 minutes; --sft's layouts run in tests/layouts/test_sft_layouts.py
def test_docs_fine_tuning(tmp_path):
    """A tiny Qwen3 imported, fine-tuned with --sft at tp 2 without the dropout it never had,
    exported; transformers answers a trained question."""
    pytest.importorskip("transformers")
    _, _, train, export, answer = run_block(page("fine-tuning.md"), tmp_path)
    first, last = loss_fall(train)
    assert first > 5.0 and last < 0.2 and "fine-tuning from" in train
    # the imported model's dropout (none) is kept: no line says it changed on load
    assert "_dropout 0.0 -> " not in train
    assert "wrote qwen3_chat_sft_hf (Qwen3ForCausalLM)" in export
    assert answer.strip() == "Lima.<|im_end|>"
