"""--fim-data: fill-in-the-middle samples equal Megatron-LM's definition (restated here on text,
drawing as it draws), for a table of cases and random documents; every rearranged document reads
back as a permutation of its text; a sample depends only on (seed, index); bad FIM flags stop in one
line; the runner trains on FIM samples."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fmeg.data.fim import FIM, FIMSettings, sample_rng

SPECIALS = [
    "<|endoftext|>",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
    "<|file_sep|>",
]
P, M, S, PAD, EOD, SEP = (
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
    "<|endoftext|>",
    "<|file_sep|>",
)


def byte_tokenizer_dir(directory) -> str:
    """A Hugging Face byte-level tokenizer (every byte a token, no merges) with the FIM and file
    tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOD}))
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from fmeg.data.tokenizers import HuggingFaceTokenizer

    return HuggingFaceTokenizer(byte_tokenizer_dir(tmp_path_factory.mktemp("fim_tokenizer")))


def definition(text: str, s: FIMSettings, rng: np.random.RandomState) -> str:
    """Megatron-LM's GPTFIMDataset on text: documents between end-of-document tokens (an empty one,
    and the token that ends it, dropped), fragments between split tokens likewise, each permuted
    with its rate."""

    def permute(piece: str, rate: float) -> str:
        if not rng.binomial(1, rate) or (s.no_prefix is not None and piece.startswith(s.no_prefix)):
            return piece
        low, high = sorted(rng.randint(low=0, high=len(piece) + 1, size=2).tolist())
        prefix, middle, suffix = piece[:low], piece[low:high], piece[high:]
        return (
            P + S + suffix + M + prefix + middle
            if rng.binomial(1, s.spm_rate)
            else P + prefix + S + suffix + M + middle
        )

    def document(doc: str) -> str:
        if s.split_sample is None or s.split_sample not in doc:
            return permute(doc, s.rate)
        if not rng.binomial(1, s.rate):
            return doc
        *fragments, last = doc.split(s.split_sample)
        return "".join(
            permute(f, s.fragment_rate) + s.split_sample for f in fragments if f
        ) + permute(last, s.fragment_rate)

    *documents, last = text.split(EOD)
    return "".join(document(d) + EOD for d in documents if d) + document(last)


def fitted(tokenizer, text: str, length: int) -> list[int]:
    ids = tokenizer.encode_plain(text)[:length]
    return ids + [tokenizer.token_to_id(PAD)] * (length - len(ids))


CASES = [  # (sample text, settings, seed, index)
    ("def add(a, b):\n    return a + b\n", FIMSettings(rate=1.0, spm_rate=0.0), 0, 0),
    ("def add(a, b):\n    return a + b\n", FIMSettings(rate=1.0, spm_rate=1.0), 0, 1),
    ("x = 1" + EOD + "y = 2" + EOD + "z", FIMSettings(rate=1.0, spm_rate=0.5), 3, 7),
    (EOD + "starts at a document's end" + EOD + EOD + "two ends", FIMSettings(rate=1.0), 1, 2),
    ("ends with its end" + EOD, FIMSettings(rate=1.0), 5, 0),
    ("# license\nprint(1)", FIMSettings(rate=1.0, no_prefix="# license"), 0, 3),
    (
        "a.py" + SEP + "import os" + SEP + SEP + "b.py",
        FIMSettings(rate=1.0, split_sample=SEP, fragment_rate=1.0),
        2,
        4,
    ),
    ("one" + SEP + "two", FIMSettings(rate=0.0, split_sample=SEP, fragment_rate=1.0), 0, 0),
    ("never", FIMSettings(rate=0.0), 0, 0),
]


@pytest.mark.parametrize("text, s, seed, index", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_fim_samples_equal_megatrons_definition(tokenizer, text, s, seed, index):
    sample = np.asarray(tokenizer.encode_plain(text), dtype=np.int64)
    got = FIM.of(s, tokenizer)(sample, sample_rng(seed, index))
    want = fitted(tokenizer, definition(text, s, sample_rng(seed, index)), len(sample))
    assert got.tolist() == want and len(got) == len(sample)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    documents=st.lists(
        st.text(alphabet="abc xyz\n()=", min_size=1, max_size=30), min_size=1, max_size=4
    ),
    spm=st.floats(0, 1),
    seed=st.integers(0, 2**31),
    index=st.integers(0, 10**6),
)
def test_every_rearranged_document_reads_back_as_its_text(tokenizer, documents, spm, seed, index):
    """With --fim-rate 1, each document becomes <prefix> .. <suffix> .. <middle> .. (PSM or SPM)
    whose pieces put back in order give the document's text, and the definition agrees; samples
    depend on (seed, index) only."""
    text = EOD.join(documents)
    s = FIMSettings(rate=1.0, spm_rate=spm)
    sample = np.asarray(tokenizer.encode_plain(text), dtype=np.int64)
    fim = FIM.of(s, tokenizer)
    got = fim(sample, sample_rng(seed, index))
    assert got.tolist() == fitted(
        tokenizer, definition(text, s, sample_rng(seed, index)), len(sample)
    )
    assert fim(sample, sample_rng(seed, index)).tolist() == got.tolist()
    pieces = tokenizer.decode(fim.rearrange(sample, sample_rng(seed, index)).tolist()).split(EOD)
    assert len(pieces) == len(documents)
    for document, piece in zip(documents, pieces):
        if piece.startswith(P + S):  # SPM: <prefix> <suffix> suffix <middle> prefix middle
            suffix, prefix_middle = piece[len(P + S) :].split(M)
            assert prefix_middle + suffix == document
        else:  # PSM: <prefix> prefix <suffix> suffix <middle> middle
            prefix, rest = piece[len(P) :].split(S)
            suffix, middle = rest.split(M)
            assert piece.startswith(P) and prefix + middle + suffix == document


def test_fim_flags_are_checked(tokenizer):
    assert FIMSettings(rate=1.5).problems() == ["--fim-rate must be in [0, 1], got 1.5"]
    assert FIMSettings(spm_rate=-0.1).problems() == ["--fim-spm-rate must be in [0, 1], got -0.1"]
    assert FIMSettings(split_sample=SEP).problems() == [
        "--fim-split-sample needs --fim-fragment-rate (the rate for each fragment)"
    ]
    with pytest.raises(ValueError, match="no --fim-prefix-token <PRE>, --fim-split-sample <sep>"):
        FIM.of(
            FIMSettings(prefix_token="<PRE>", split_sample="<sep>", fragment_rate=0.5), tokenizer
        )


def code_corpus(tmp_path, documents: int) -> list[str]:
    """The runner's data and tokenizer flags for small Python functions preprocessed with the FIM
    tokenizer."""
    from recipes import preprocess_data

    (tmp_path / "code.jsonl").write_text(
        "".join(
            json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n"
            for i in range(documents)
        )
    )
    tokenizer = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        byte_tokenizer_dir(tmp_path / "tok"),
    ]
    assert (
        preprocess_data.main(
            [
                "--input",
                str(tmp_path / "code.jsonl"),
                "--output-prefix",
                str(tmp_path / "code"),
                "--append-eod",
                *tokenizer,
            ]
        )
        == 0
    )
    return ["--data-path", str(tmp_path / "code_text_document"), *tokenizer]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--fim-rate", "2"], "--fim-rate must be in [0, 1], got 2.0"),
        (["--fim-spm-rate", "-1"], "--fim-spm-rate must be in [0, 1], got -1.0"),
        (["--fim-prefix-token", "<PRE>"], "the tokenizer has no --fim-prefix-token <PRE>"),
    ],
)
def test_bad_fim_input_is_one_line_exit_2(tmp_path, monkeypatch, flags, needle):
    from harness.bad_input import assert_one_line_exit_2_nothing_left

    argv = ["--fim-data", *code_corpus(tmp_path, 50), *flags]
    assert_one_line_exit_2_nothing_left(tmp_path, monkeypatch, "gpt_pretrain", argv, needle)


def test_the_runner_trains_on_fim_samples(tmp_path):
    from harness.runner import run_recipe

    common = [*code_corpus(tmp_path, 300), "--seq-length", "64", "--max-position-embeddings", "64"]
    plain, _ = run_recipe(tmp_path, "plain", 1, common)
    fim, _ = run_recipe(tmp_path, "fim", 1, [*common, "--fim-data", "--fim-rate", "0.9"])
    losses = [r["lm_loss"] for r in fim if "lm_loss" in r]
    assert len(losses) == 20 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert losses != [r["lm_loss"] for r in plain if "lm_loss" in r]
