"""Blends follow their weights at every prefix; splits and sample counts are Megatron's; samplers
resume exactly and give data-parallel ranks disjoint slices covering each step."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fmeg.data.blending import (
    BlendedDataset,
    blending_indices,
    build_datasets,
    parse_blend,
    parse_split,
    split_document_ranges,
    target_samples,
)
from fmeg.data.samplers import cyclic_random_batches, sequential_batches

weights_st = st.lists(st.floats(0.01, 10.0), min_size=1, max_size=5).map(
    lambda w: [x / sum(w) for x in w]
)


@given(weights_st, st.integers(1, 400))
def test_blend_proportions_are_within_one_sample_at_every_prefix(weights, size):
    """Megatron's order (kept so blends reproduce Megatron runs): after n samples each dataset's
    count is within one sample of weight * max(n - 1, 1), the target Megatron's greedy rule uses,
    hence within 1 + weight of weight * n."""
    dataset, within = blending_indices(weights, size)
    counts, w = np.zeros(len(weights)), np.array(weights)
    for i, d in enumerate(dataset):
        counts[d] += 1
        n = i + 1
        assert within[i] == counts[d] - 1
        assert np.all(np.abs(counts - w * max(n - 1, 1)) <= 1.0 + 1e-9), (n, counts)
        assert np.all(np.abs(counts - w * n) <= 1.0 + w + 1e-9), (n, counts)


@given(weights_st, st.integers(1, 300))
def test_blend_equals_megatron_core_helper(weights, size):
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    di, si = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(
        di, si, np.array(weights, dtype=np.float64), len(weights), size, False
    )
    ours = blending_indices(weights, size)
    np.testing.assert_array_equal(ours[0], di)
    np.testing.assert_array_equal(ours[1], si)


def test_blended_dataset_reads_through():
    blend = BlendedDataset([list(range(100)), list(range(1000, 1100))], [0.25, 0.75], 40)
    items = [blend[i] for i in range(len(blend))]
    assert sum(x >= 1000 for x in items) == 30 and items[:4] == [1000, 0, 1001, 1002]
    with pytest.raises(ValueError, match="dataset 0 has 2 samples, the blend needs"):
        BlendedDataset([[1, 2], list(range(100))], [0.5, 0.5], 40)


def test_parse_blend_and_split():
    assert parse_blend("30 a 70 b") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["1 a", "3 b"]) == (["a", "b"], [0.25, 0.75])
    assert parse_blend("only") == (["only"], [1.0])
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("30 a 70", "weight prefix pairs"),
        ("x a 70 b", "weights must be numbers"),
        ("0 a 0 b", "positive sum"),
    ],
)
def test_bad_blends_are_refused(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_blend(text)


@pytest.mark.parametrize("text", ["0,0,0", "a,b", "1,2,3,4", "-1,2"])
def test_bad_splits_are_refused(text):
    with pytest.raises(ValueError, match="--split"):
        parse_split(text)


@pytest.mark.parametrize(
    "split, n", [("969,30,1", 1000), ("98,2,0", 37), ("1,1,1", 10), ("80,20", 7)]
)
def test_split_ranges_follow_megatron_rounding(split, n):
    config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")
    matrix = config.convert_split_vector_to_split_matrix(config.parse_and_normalize_split(split))
    want = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
    assert split_document_ranges(split, n) == want


def test_target_samples():
    assert target_samples(100, 16, 10, 5) == [1600, 11 * 5 * 16, 80]


@given(st.integers(1, 200), st.integers(1, 4), st.integers(1, 4), st.data())
def test_sequential_sampler_resumes_and_slices_by_rank(total, micro, dp, data):
    step = micro * dp
    consumed = data.draw(st.integers(0, max(0, total - step)).map(lambda c: c - c % step))
    per_rank = [list(sequential_batches(total, consumed, micro, dp, r)) for r in range(dp)]
    for batches in zip(*per_rank):
        flat = [i for b in batches for i in b]
        assert len(flat) == step and len(set(flat)) == step and flat == sorted(flat)
    full = list(sequential_batches(total, 0, micro, dp, 0))
    assert per_rank[0] == full[consumed // step :]


@given(
    st.integers(4, 120), st.integers(1, 3), st.integers(1, 3), st.integers(0, 5), st.integers(0, 40)
)
def test_cyclic_sampler_resumes_at_any_consumed_count(total, micro, dp, seed, resume_step):
    step = micro * dp
    if total < step:
        return
    streams = [cyclic_random_batches(total, 0, micro, dp, r, seed) for r in range(dp)]
    reference = [list(itertools.islice(s, resume_step + 10)) for s in streams]
    for r in range(dp):
        resumed = list(
            itertools.islice(
                cyclic_random_batches(total, resume_step * step, micro, dp, r, seed), 10
            )
        )
        assert resumed == reference[r][resume_step:]
    for batches in zip(*reference):
        flat = [i for b in batches for i in b]
        assert len(set(flat)) == step and all(0 <= i < total for i in flat)


def test_sampler_errors():
    with pytest.raises(ValueError, match="rank"):
        list(sequential_batches(10, 0, 2, 2, 2))
    with pytest.raises(ValueError, match="fewer than one step"):
        next(cyclic_random_batches(3, 0, 2, 2, 0))


def test_build_datasets_from_flags(tmp_path):
    from fmeg.data.indexed import IndexedDatasetBuilder

    for name, base in (("a", 0), ("b", 500)):
        b = IndexedDatasetBuilder(tmp_path / name, np.uint16)
        for i in range(100):
            b.add_document(np.full(20, base + i))
        b.finalize()
    train, valid, test = build_datasets(
        f"30 {tmp_path / 'a'} 70 {tmp_path / 'b'}", "90,10,0", 16, [200, 20, 0], 1
    )
    assert len(train) == 200 and len(valid) == 20 and test is None
    from_b = sum(int(train[i]["tokens"][0]) >= 500 for i in range(200))
    assert from_b == 140
    # validation samples come from the validation documents (90..99 of each prefix)
    assert all(int(t) % 500 >= 90 for i in range(20) for t in valid[i]["tokens"])
    single, _, _ = build_datasets(str(tmp_path / "a"), "1", 16, [10, 0, 0], 1)
    assert len(single) >= 10  # like megatron-core: every full sample of the epochs built
