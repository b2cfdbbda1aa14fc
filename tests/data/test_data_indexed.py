"""The .bin/.idx format: fmeg and megatron-core read each other's files for every dtype code;
malformed files fail with one line naming the file; writes are atomic."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg.data.indexed import DTYPES, DataError, IndexedDataset, IndexedDatasetBuilder, best_dtype


def documents(seed, dtype, n=6):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 120, size=rng.integers(3, 30)).astype(dtype) for _ in range(n)]


def write(prefix, docs, dtype):
    b = IndexedDatasetBuilder(prefix, dtype)
    for d in docs:
        b.add_document(d)
    b.finalize()


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype_code(tmp_path, code):
    dtype, docs = DTYPES[code], documents(code, DTYPES[code])
    write(tmp_path / "d", docs, dtype)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(docs) and ds.num_documents == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        np.testing.assert_array_equal(ds.get(i, 1, 2), d[1:3])
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path, code):
    core = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    dtype, docs = DTYPES[code], documents(code + 10, DTYPES[code])
    write(tmp_path / "ours", docs, dtype)
    theirs_reader = core.IndexedDataset(str(tmp_path / "ours"))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs_reader[i], d)
    builder = core.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for d in docs:
        builder.add_document(
            torch.from_numpy(d.astype(np.float64 if d.dtype.kind == "f" else np.int64)), [len(d)]
        )
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(tmp_path / "theirs")
    assert ours.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ours.document_indices, theirs_reader.document_indices)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours[i], d)


def test_multi_sequence_documents_and_merging(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "a", np.int32)
    b.add_document(np.arange(10), lengths=[3, 7])
    b.add_document(np.arange(4))
    b.finalize()
    write(tmp_path / "b", [np.arange(5, dtype=np.int32)], np.int32)
    merged = IndexedDatasetBuilder(tmp_path / "m", np.int32)
    merged.add_index(tmp_path / "a")
    merged.add_index(tmp_path / "b")
    merged.finalize()
    m = IndexedDataset(tmp_path / "m")
    assert m.document_indices.tolist() == [0, 2, 3, 4] and m.sequence_lengths.tolist() == [
        3,
        7,
        4,
        5,
    ]
    np.testing.assert_array_equal(m[1], np.arange(3, 10))
    np.testing.assert_array_equal(m[3], np.arange(5))


@given(st.lists(st.lists(st.integers(0, 60000), min_size=1, max_size=20), min_size=1, max_size=10))
def test_any_documents_round_trip(tmp_path_factory, docs):
    prefix = tmp_path_factory.mktemp("h") / "d"
    write(prefix, [np.array(d, np.uint16) for d in docs], np.uint16)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == docs


def test_best_dtype():
    assert best_dtype(50257) is np.uint16 and best_dtype(128256) is np.int32


@pytest.fixture
def good(tmp_path):
    write(tmp_path / "g", documents(0, np.uint16), np.uint16)
    return tmp_path / "g"


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-4]),
            r"g\.bin: .* truncated",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(
                b"NOTANIDX" + p.with_suffix(".idx").read_bytes()[8:]
            ),
            r"g\.idx: not a Megatron index",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(
                p.with_suffix(".idx").read_bytes()[:9]
                + (2).to_bytes(8, "little")
                + p.with_suffix(".idx").read_bytes()[17:]
            ),
            r"g\.idx: index version 2",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(
                p.with_suffix(".idx").read_bytes()[:17]
                + bytes([9])
                + p.with_suffix(".idx").read_bytes()[18:]
            ),
            r"g\.idx: unknown dtype code 9",
        ),
        (
            lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:-8]),
            r"g\.idx: .* truncated",
        ),
        (lambda p: p.with_suffix(".idx").write_bytes(b"MMID"), r"g\.idx: 4 bytes is shorter"),
        (lambda p: p.with_suffix(".bin").unlink(), r"g\.bin: no such file"),
    ],
)
def test_malformed_files_fail_with_one_line_naming_the_file(good, damage, message):
    damage(good)
    with pytest.raises(DataError, match=message) as info:
        IndexedDataset(good)
    assert "\n" not in str(info.value)


def test_an_unfinished_build_leaves_no_readable_dataset(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "x", np.uint16)
    b.add_document(np.arange(5))
    with pytest.raises(DataError, match="no such file"):
        IndexedDataset(tmp_path / "x")
