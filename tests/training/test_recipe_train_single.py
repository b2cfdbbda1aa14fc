"""recipes.train_single: trains from flags, and refuses bad input with one line naming the flag or
file."""

import numpy as np
import pytest

from recipes import train_single

QUICK = [
    "--no-compile",
    "--train-iters",
    "4",
    "--log-interval",
    "2",
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--lr-warmup-iters",
    "1",
]


def test_trains_on_the_default_corpus(capsys):
    assert train_single.main(QUICK) == 0
    out = capsys.readouterr().out
    assert "iteration        4/       4 | consumed samples:            8" in out
    assert "lm loss:" in out and "grad norm:" in out and "done: 4 iterations" in out


def test_trains_on_a_npy_token_file_with_llama(tmp_path, capsys):
    path = tmp_path / "tokens.npy"
    np.save(path, (np.arange(500) % 50).astype(np.int32))
    assert (
        train_single.main(
            QUICK + ["--data-path", str(path), "--model", "llama", "--num-query-groups", "2"]
        )
        == 0
    )
    assert "vocab 50" in capsys.readouterr().out


def test_trains_on_a_megatron_prefix(tmp_path, capsys):
    from fmeg.data.indexed import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(tmp_path / "corpus_text_document", np.uint16)
    for i in range(20):
        b.add_document(np.arange(i, i + 30) % 90)
    b.finalize()
    assert train_single.main(QUICK + ["--data-path", str(tmp_path / "corpus_text_document")]) == 0
    assert "600 tokens, vocab 49" in capsys.readouterr().out  # ids 0..48


def test_trains_on_a_raw_bin_file(tmp_path, capsys):
    path = tmp_path / "train.bin"
    (np.arange(500) % 70).astype(np.uint16).tofile(path)
    assert train_single.main(QUICK + ["--data-path", str(path), "--vocab-size", "128"]) == 0
    assert "vocab 128" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--num-attention-heads", "3"], "--num-attention-heads"),
        (["--num-query-groups", "3"], "--num-query-groups"),
        (["--data-path", "/nonexistent/tokens.npy"], "no such file"),
        (["--hidden-dropout", "1.5"], "--hidden-dropout"),
        (["--seq-length", "0"], "--seq-length"),
        (["--min-lr", "1.0"], "--min-lr"),
        (["--lr-warmup-iters", "10"], "--lr-decay-iters"),
    ],
)
def test_bad_flags_fail_with_one_line(extra, needle, capsys):
    assert train_single.main(QUICK + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error:") and needle in err


def test_short_data_and_bad_files_are_refused(tmp_path, capsys):
    short = tmp_path / "short.npy"
    np.save(short, np.arange(10, dtype=np.int64))
    assert train_single.main(QUICK + ["--data-path", str(short)]) == 2
    assert "--seq-length 16 needs at least 18 tokens" in capsys.readouterr().err
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    assert train_single.main(QUICK + ["--data-path", str(odd)]) == 2
    assert "--token-dtype" in capsys.readouterr().err
    small_vocab = tmp_path / "v.npy"
    np.save(small_vocab, np.arange(100, dtype=np.int64))
    assert train_single.main(QUICK + ["--data-path", str(small_vocab), "--vocab-size", "10"]) == 2
    assert "--vocab-size 10" in capsys.readouterr().err
