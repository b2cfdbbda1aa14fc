"""recipes.preprocess_data and the tokenizers; the embedded default corpus."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from fmeg.data.default_corpus import default_corpus, stdlib_sources
from fmeg.data.indexed import IndexedDataset
from fmeg.data.tokenizers import (
    ByteTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    padded_vocab_size,
)
from recipes import preprocess_data
from harness.data_files import bpe_files


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"text": f"document {i} " * (i % 5 + 1), "title": f"t{i}"}) for i in range(300)
    ]
    lines.insert(10, "{broken")
    lines.insert(20, json.dumps({"title": "no text"}))
    lines.insert(30, json.dumps({"text": 5, "title": "x"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_preprocess_writes_megatron_files_and_reports_bad_lines(tmp_path, jsonl, capsys):
    assert (
        preprocess_data.main(
            [
                "--input",
                str(jsonl),
                "--output-prefix",
                str(tmp_path / "o"),
                "--append-eod",
                "--json-keys",
                "text",
                "title",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "done: 300 documents" in out and "3 bad lines skipped" in out
    assert (
        f"{jsonl}:11: invalid JSON" in out
        and f"{jsonl}:21: no key 'text'" in out
        and "holds int" in out
    )
    text = IndexedDataset(tmp_path / "o_text_document")
    assert text.num_documents == 300 and text.dtype == np.uint16
    assert (
        bytes(text[0][:-1].astype(np.uint8)).decode() == "document 0 "
        and text[0][-1] == ByteTokenizer.eod
    )
    assert IndexedDataset(tmp_path / "o_title_document").num_documents == 300


def test_workers_give_the_same_files(tmp_path, jsonl):
    for workers in (1, 3):
        assert (
            preprocess_data.main(
                [
                    "--input",
                    str(jsonl),
                    "--output-prefix",
                    str(tmp_path / f"w{workers}"),
                    "--workers",
                    str(workers),
                    "--append-eod",
                ]
            )
            == 0
        )
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{suffix}").read_bytes() == (
            tmp_path / f"w3_text_document{suffix}"
        ).read_bytes()


def test_strict_stops_at_the_first_bad_line_and_leaves_nothing(tmp_path, jsonl, capsys):
    assert (
        preprocess_data.main(
            ["--input", str(jsonl), "--output-prefix", str(tmp_path / "s"), "--strict"]
        )
        == 2
    )
    assert ":11: invalid JSON" in capsys.readouterr().err
    assert not list(tmp_path.glob("s_*"))


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "no documents (it has no non-blank lines)"),
        (b"\n  \n", "no documents (it has no non-blank lines)"),
        (
            b'{"title": "a"}\n{"title": "b"}\n',
            "no documents (all 2 lines were skipped, the first IN:1: no key 'text')",
        ),
        (
            b'{"text": "caf\xe9"}\n',
            "no documents (all 1 lines were skipped, the first IN:1: not UTF-8 (byte 0xe9 at "
            "column 14))",
        ),
    ],
)
def test_input_that_yields_no_documents_writes_nothing(tmp_path, capsys, content, needle):
    """An empty input, or one whose every line is skipped (a missing key, bytes that are not UTF-8),
    is refused in one line naming the input and the first bad line, exit 2, and no dataset is
    written."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(content)
    assert (
        preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "out")])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: --input {source}: {needle.replace('IN', str(source))}; nothing was written"
    ), err
    assert not list(tmp_path.glob("out*"))


def test_a_line_that_is_not_utf8_is_named_and_skipped(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n{"text": "fine"}\n')
    assert (
        preprocess_data.main(["--input", str(source), "--output-prefix", str(tmp_path / "o")]) == 0
    )
    out = capsys.readouterr().out
    assert "done: 2 documents" in out and f"{source}:2: not UTF-8 (byte 0xff at column 11)" in out


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--input", "/nope.jsonl"], "--input /nope.jsonl: no such file"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model"),
        (["--workers", "0"], "--workers"),
    ],
)
def test_bad_flags_fail_with_one_line(tmp_path, jsonl, flags, needle, capsys):
    argv = ["--input", str(jsonl), "--output-prefix", str(tmp_path / "x")] + flags
    assert preprocess_data.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_gpt2_bpe_and_tokenizer_json(tmp_path, jsonl):
    pytest.importorskip("tokenizers")
    vocab, merges = bpe_files(tmp_path)
    bpe = GPT2BPETokenizer(str(vocab), str(merges))
    ids = bpe.encode("hello there")
    assert (
        bpe.decode(ids) == "hello there"
        and ids.count(vocab_id := json.loads(vocab.read_text())["he"]) == 2
    )
    bpe._tok.save(str(tmp_path / "tokenizer.json"))
    hf = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert hf.encode("hello there") == ids and hf.eod == bpe.eod == vocab_id + 1
    assert (
        preprocess_data.main(
            [
                "--input",
                str(jsonl),
                "--output-prefix",
                str(tmp_path / "b"),
                "--append-eod",
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                str(vocab),
                "--merge-file",
                str(merges),
            ]
        )
        == 0
    )
    first = IndexedDataset(tmp_path / "b_text_document")[0]
    assert bpe.decode(first[:-1].tolist()) == "document 0 " and first[-1] == bpe.eod


def test_padded_vocab_size():
    assert padded_vocab_size(50257) == 50304 and padded_vocab_size(50257, tp=8) == 51200


def test_default_corpus_is_the_standard_library_and_is_cached(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    ds = default_corpus(tmp_path)
    # the first build says, in one line, what it tokenizes, where, and that it happens once
    (said,) = capsys.readouterr().out.splitlines()
    assert said.startswith("tokenizing the default corpus once (Python ")
    assert f"{ds.prefix}.bin and .idx; later runs reuse it" in said
    files = stdlib_sources()
    assert ds.num_documents == len(files) > 100
    assert (
        bytes(ds[0][:-1].astype(np.uint8)) == files[0].read_bytes()
        and ds[0][-1] == ByteTokenizer.eod
    )
    # every .py file of the standard library outside site-packages, as a plain walk finds them
    # (the listing prunes site-packages rather than walking it)
    root = Path(sysconfig.get_paths()["stdlib"])
    everything = root.rglob("*.py")
    assert files == sorted(p for p in everything if "site-packages" not in p.parts and p.is_file())
    built = sorted(p.name for p in tmp_path.iterdir())
    again = default_corpus(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == built and again.prefix == ds.prefix
    assert capsys.readouterr().out == ""


def test_a_full_disk_or_a_read_only_directory_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch, capsys
):
    """Writing fails (ENOSPC after some documents, EACCES at the first file, ENOSPC at the index):
    one error line naming --output-prefix, exit 2, and no .bin, .idx or .tmp file left behind."""
    import builtins
    import errno
    import json

    from fmeg.data import indexed
    from recipes import preprocess_data

    source = tmp_path / "in.jsonl"
    source.write_text(
        "\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(50)) + "\n"
    )
    out = tmp_path / "out"
    out.mkdir()
    real_add, real_open = indexed.IndexedDatasetBuilder.add_document, builtins.open
    written = []

    def full_after_10(self, tokens, lengths=None):
        written.append(1)
        if len(written) > 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_add(self, tokens, lengths)

    def refuse(name, fail_on):
        def patched(path, *args, **kwargs):
            if str(path).endswith(fail_on):
                raise OSError(errno.EACCES if fail_on == ".bin.tmp" else errno.ENOSPC, name)
            return real_open(path, *args, **kwargs)

        return patched

    for patch in (
        (indexed.IndexedDatasetBuilder, "add_document", full_after_10),
        (builtins, "open", refuse("Permission denied", ".bin.tmp")),
        (builtins, "open", refuse("No space left on device", ".idx.tmp")),
    ):
        with monkeypatch.context() as m:
            m.setattr(*patch)
            code = preprocess_data.main(["--input", str(source), "--output-prefix", str(out / "c")])
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            code == 2
            and len(err) == 1
            and err[0].startswith(f"error: --output-prefix {out / 'c'}: cannot write")
        ), err
        assert list(out.iterdir()) == []
