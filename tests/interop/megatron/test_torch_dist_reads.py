"""fmeg's reader of PyTorch distributed checkpoints (Megatron's torch_dist) against the tensors
written: any box of any tensor, however the chunks cut it, reads back equal, and of a chunk only
part of which is needed only the rows that hold the part are read."""

import warnings

import torch
from hypothesis import given, settings, strategies as st

from fmeg.checkpoint.boxes import Box
from fmeg.interop.megatron.torch_dist import TorchDistDir, rows_needed


def _save(path, state):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


@st.composite
def tensor_and_box(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    offset = tuple(draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offset))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return shape, Box(offset, size), dtype


@settings(max_examples=40, deadline=None)
@given(tensor_and_box())
def test_any_box_reads_back_what_was_written(tmp_path_factory, case):
    shape, box, dtype = case
    path = tmp_path_factory.mktemp("dcp")
    full = (torch.arange(torch.Size(shape).numel()) % 251 - 125).to(dtype).reshape(shape)
    _save(path, {"t": full, "layer": full[None].clone()})
    reader = TorchDistDir(path)
    out = torch.empty(box.shape, dtype=dtype)
    reader.read([("t", box, out)])
    assert torch.equal(out, full[tuple(slice(o, e) for o, e in zip(box.offset, box.end))])
    stacked = torch.empty((1, *box.shape), dtype=dtype)
    reader.read([("layer", Box((0, *box.offset), (1, *box.shape)), stacked)])
    assert torch.equal(stacked[0], out)


def test_a_rank_reads_the_rows_it_needs_not_the_chunk(tmp_path):
    """A [1024, 256] fp32 chunk (1 MiB) of which rows 256-511 are needed: about a quarter of it is
    read."""
    full = torch.randn(1024, 256)
    _save(tmp_path, {"w": full})
    reader = TorchDistDir(tmp_path)
    before = reader.bytes_read
    out = torch.empty(256, 256)
    reader.read([("w", Box((256, 0), (256, 256)), out)])
    assert torch.equal(out, full[256:512])
    assert reader.bytes_read - before < 256 * 256 * 4 + 4096


def test_rows_needed_is_the_least_contiguous_run():
    chunk = Box((0, 4, 0), (1, 8, 16))
    assert rows_needed(chunk, [Box((0, 6, 0), (1, 2, 16))]) == Box((0, 6, 0), (1, 2, 16))
    assert rows_needed(chunk, [Box((0, 6, 3), (1, 1, 2)), Box((0, 9, 0), (1, 1, 1))]) == Box(
        (0, 6, 0), (1, 4, 16)
    )
    # columns: all rows
    assert rows_needed(Box((0, 0), (2, 8)), [Box((0, 2), (2, 2))]) == Box((0, 0), (2, 8))
    assert rows_needed(Box((0, 0), (4, 8)), [Box((0, 0), (4, 8))]) == Box((0, 0), (4, 8))
