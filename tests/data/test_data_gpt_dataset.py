"""GPT samples: Megatron's order for the same files and seed, every split token in order, cached
indices."""

import logging
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fmeg.data.gpt_dataset import GPTDataset, build_indices
from fmeg.data.indexed import IndexedDataset, IndexedDatasetBuilder


def corpus(path, seed=0, docs=30, vocab=999, eod=None):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(path, np.uint16)
    for _ in range(docs):
        d = rng.integers(1, vocab, size=rng.integers(1, 50))
        b.add_document(np.append(d, eod) if eod is not None else d)
    b.finalize()
    return IndexedDataset(path)


@pytest.mark.parametrize(
    "seed, seq, docs, samples",
    [
        (1234, 16, (0, 30), 40),
        (7, 8, (3, 25), 160),
        (3, 32, (0, 30), 220),
        (5, 4, (10, 12), 40),
        (9, 16, (0, 30), 100),
    ],
)
def test_samples_equal_megatron_core_gpt_dataset(tmp_path, seed, seq, docs, samples):
    core = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreIndexed
    from megatron.core.datasets.utils import Split

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    ours_ix = corpus(tmp_path / "c", seed)

    class Tok:
        eod, pad, vocab_size, unique_identifiers = 0, -1, 1000, {"class": "Tok"}

    config = core.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        split="1,0,0",
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None,
        mmap_bin_files=True,
    )
    indices = np.arange(*docs, dtype=np.int32)
    theirs = core.GPTDataset(
        CoreIndexed(str(tmp_path / "c")), str(tmp_path / "c"), indices, samples, Split.train, config
    )
    ours = GPTDataset(ours_ix, indices, seq, samples, seed)
    assert len(ours) == len(theirs)
    for i in range(len(ours)):
        np.testing.assert_array_equal(ours[i]["tokens"].numpy(), theirs[i]["tokens"].numpy())
        np.testing.assert_array_equal(ours[i]["labels"].numpy(), theirs[i]["labels"].numpy())


@pytest.mark.parametrize(
    "seed, seq, flags",
    [
        (0, 16, (True, True, True)),
        (1, 32, (True, False, True)),
        (2, 24, (False, True, False)),
        (3, 8, (True, True, False)),
        (4, 64, (False, False, True)),
    ],
)
def test_masks_and_positions_equal_megatron_core_gpt_dataset(tmp_path, seed, seq, flags):
    """reset_position_ids, reset_attention_mask and eod_mask_loss as megatron-core's GPTDataset
    builds them on the same indexed data: the loss mask and position ids equal, and the documents of
    cu_seqlens are its [s, s] attention mask (a key visible to a query: at or before it, in its
    document)."""
    core = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreIndexed
    from megatron.core.datasets.utils import Split

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    reset_position_ids, reset_attention_mask, eod_mask_loss = flags
    eod = 999
    ours_ix = corpus(tmp_path / "c", seed, docs=60, vocab=eod, eod=eod)

    class Tok:
        pad, vocab_size, unique_identifiers = -1, 1000, {"class": "Tok"}

    Tok.eod = eod
    config = core.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        split="1,0,0",
        tokenizer=Tok(),
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=True,
        path_to_cache=None,
        mmap_bin_files=True,
    )
    indices = np.arange(60, dtype=np.int32)
    theirs = core.GPTDataset(
        CoreIndexed(str(tmp_path / "c")), str(tmp_path / "c"), indices, 40, Split.train, config
    )
    ours = GPTDataset(
        ours_ix,
        indices,
        seq,
        40,
        seed,
        eod_id=eod,
        eod_mask_loss=eod_mask_loss,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
    )
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    several = 0
    for i in range(len(ours)):
        mine, want = ours[i], theirs[i]
        np.testing.assert_array_equal(mine["tokens"].numpy(), want["tokens"].numpy())
        np.testing.assert_array_equal(mine["loss_mask"].numpy(), want["loss_mask"].numpy())
        np.testing.assert_array_equal(mine["position_ids"].numpy(), want["position_ids"].numpy())
        visible = causal
        if reset_attention_mask:
            document = np.searchsorted(mine["cu_seqlens"].numpy(), np.arange(seq), side="right")
            visible = causal & (document[:, None] == document[None, :])
            several += document.max() > 1
        else:
            assert "cu_seqlens" not in mine
        np.testing.assert_array_equal(~visible, want["attention_mask"][0].numpy())
    assert several or not reset_attention_mask  # the samples do pack several documents


@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=25), st.integers(1, 12), st.integers(0, 100)
)
def test_unshuffled_samples_tile_the_split_in_order_sharing_one_token(lengths, seq, seed):
    total = sum(lengths)
    if total < seq + 1:
        return
    lengths = np.array(lengths, dtype=np.int32)
    documents = np.arange(len(lengths))
    doc_index, sample_index, shuffle = build_indices(lengths, documents, seq, None, seed)
    stream = np.concatenate(
        [np.arange(lengths[:d].sum(), lengths[: d + 1].sum()) for d in doc_index]
    )
    starts = [int(lengths[doc_index[:p]].sum()) + o for p, o in sample_index]
    assert starts == [k * seq for k in range(len(sample_index))]  # sample k starts at token k * seq
    assert len(sample_index) - 1 == (total - 1) // seq  # every full sample of the epoch
    assert sorted(shuffle.tolist()) == list(range(len(sample_index) - 1))
    assert sorted(doc_index.tolist()) == sorted(documents.tolist())
    # one epoch: every token of the split exactly once, in document_index order
    assert len(stream) == total
    covered = (len(sample_index) - 1) * seq + 1  # samples cover the stream's prefix, in order
    assert 0 <= total - covered < seq  # only a partial last sample is dropped, as in Megatron


def test_indices_are_cached_and_reused(tmp_path):
    ix = corpus(tmp_path / "c")
    first = GPTDataset(ix, np.arange(30), 16, 50, 1, cache_dir=tmp_path / "cache")
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len([f for f in files if f.endswith(".npy")]) == 3 and any(
        f.endswith("description.json") for f in files
    )
    again = GPTDataset(ix, np.arange(30), 16, 50, 1, cache_dir=tmp_path / "cache")
    assert isinstance(again.shuffle_index, np.memmap)
    for i in range(len(first)):
        np.testing.assert_array_equal(first[i]["tokens"], again[i]["tokens"])
    # another seed, another key
    other = GPTDataset(ix, np.arange(30), 16, 50, 2, cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 6 and not np.array_equal(
        other.shuffle_index, first.shuffle_index
    )


def test_eod_mask_loss_and_sample_fields(tmp_path):
    ix = corpus(tmp_path / "c", eod=1000, vocab=999)
    ds = GPTDataset(ix, np.arange(30), 16, 20, 0, eod_id=1000, eod_mask_loss=True)
    sample = ds[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    # megatron-core's: inputs that end a document
    assert (sample["loss_mask"][sample["tokens"] == 1000] == 0).all()
    assert (sample["loss_mask"][sample["tokens"] != 1000] == 1).all()
    assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()


def test_a_sequence_longer_than_the_data_is_refused(tmp_path):
    ix = corpus(tmp_path / "c", docs=2)
    with pytest.raises(
        ValueError, match=r"c: --seq-length 4096 is larger than the train split's \d+ tokens"
    ):
        GPTDataset(ix, np.arange(2), 4096, 1, 0)


def test_mock_dataset_is_deterministic():
    from fmeg.data.gpt_dataset import MockGPTDataset

    a, b = MockGPTDataset(10, 8, 50, seed=1), MockGPTDataset(10, 8, 50, seed=1)
    assert len(a) == 10 and a[3]["tokens"].tolist() == b[3]["tokens"].tolist()
    assert (
        a[3]["tokens"][1:].tolist() == a[3]["labels"][:-1].tolist()
        and int(a[3]["tokens"].max()) < 50
    )
