"""Placements, property-tested without processes: every rank of a layout A writes its state, every
rank of a layout B reads its own, and each B rank then holds exactly what sharding the same model
and optimizer state for B directly gives it, bitwise: weights, fp32 master weights, Adam's moments
(whole or distributed-optimizer slices) and the step count, for tp, pp (with virtual stages), dp,
cp, ep and the experts' own tp, with tiny cells (so that boxes cut cells, and replicas share them)
and vocabulary padding that follows tp. Every rank's mesh is built from the rank groups alone:
placements need no communicator."""

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from fmeg import checkpoint, tree
from fmeg.checkpoint.load import FORMAT
from fmeg.data.tokenizers import padded_vocab_size
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.training.checkpoint_state import count_piece, held_zeros, placements, regions, save_pieces
from fmeg.state.experts import split_experts
from fmeg.state.flat import SHARDINGS
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params
from fmeg.training.run_state import read_state
from harness.checkpoints import mesh_of

BASE = gpt.GPTConfig.gpt2(vocab_size=50, max_seq_len=16, num_layers=4, hidden_size=16, num_heads=4)
MOE = BASE.replace(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8)


@st.composite
def layouts(draw, moe: bool) -> Layout:
    tp, pp, cp, dp = (draw(st.sampled_from([1, 2])) for _ in range(4))
    chunks = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if (cp * dp) % e == 0])) if moe else 1
    etp = draw(st.sampled_from([None, 1])) if moe and tp > 1 else None
    return Layout(
        tp=tp,
        pp=pp,
        chunks=chunks,
        dp=dp,
        cp=cp,
        ep=ep,
        etp=etp,
        sharding=draw(st.sampled_from(SHARDINGS)),
    )


def config_for(base: gpt.GPTConfig, layout: Layout) -> gpt.GPTConfig:
    return base.replace(padded_vocab_size=padded_vocab_size(base.vocab_size, layout.tp, 8))


def full_trees(config: gpt.GPTConfig) -> dict:
    """The whole model's weights and optimizer state (padding rows zero, as fmeg keeps them)."""
    return {
        "params": gpt.init(config, 0),
        "main": gpt.init(config, 1),
        "mu": gpt.init(config, 2),
        "nu": tree.tree_map(torch.abs, gpt.init(config, 3)),
    }


def state_of(config, layout: Layout, mesh: Mesh, dtype: torch.dtype, values: dict | None):
    """A rank's state whose buffers hold its share of values (None: zeros, to be read into)."""
    local = (
        shard_params(values["params"], config, layout, mesh)
        if values
        else held_zeros(config, layout, mesh)
    )
    state = init_state(local, config, layout, mesh, compute_dtype=dtype)
    for kind in ("main", "mu", "nu") if values else ():
        mine = shard_params(values[kind], config, layout, mesh)
        trees = split_experts(mine) if len(state.parts) > 1 else (mine,)
        for part, part_tree in zip(state.parts, trees):
            if kind in part.buffers():
                buffer, runs = part.buffers()[kind]
                flat = part.flat.flatten(part_tree)
                for lo, hi, at in runs:
                    buffer[at : at + hi - lo].copy_(flat[lo:hi])
    if values:
        state.set_count(7)
    return state


class _Run:  # what read_state reads of a RunConfig
    def __init__(self, config, layout):
        self.model, self.layout = config, layout
        self.checkpoint = type("C", (), {"fully_parallel_load": False})()


def save(root, base, layout: Layout, dtype, fully_parallel: bool):
    config = config_for(base, layout)
    world, values = layout.tp * layout.pp * layout.cp * layout.dp, full_trees(config)
    tmp = checkpoint.temporary_dir(root, 1, "0")
    tmp.mkdir(parents=True)
    for rank in range(world):
        mesh = mesh_of(layout, rank)
        state = state_of(config, layout, mesh, dtype, values)
        pieces = save_pieces(
            regions(state, placements(state, config, layout, mesh)), fully_parallel, max_cell=96
        )
        checkpoint.write_rank(
            tmp, rank, {}, pieces + ([count_piece(state.parts[0].count)] if rank == 0 else [])
        )
    return checkpoint.finalize(root, 1, {"format": FORMAT, "world_size": world})


@given(
    moe=st.booleans(),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fully_parallel=st.booleans(),
)
def test_any_layout_reads_what_any_other_wrote_bitwise(
    tmp_path_factory, moe, data, dtype, fully_parallel
):
    a, b = data.draw(layouts(moe), "saved at"), data.draw(layouts(moe), "read at")
    base = MOE if moe else BASE
    path = save(tmp_path_factory.mktemp("ck"), base, a, dtype, fully_parallel)
    config = config_for(base, b)
    values = full_trees(config)
    with checkpoint.Checkpoint.open(path) as ckpt:
        for rank in range(b.tp * b.pp * b.cp * b.dp):
            mesh = mesh_of(b, rank)
            got, want = (
                state_of(config, b, mesh, dtype, None),
                state_of(config, b, mesh, dtype, values),
            )
            before = ckpt.cell_bytes_read
            read_state(ckpt, got, _Run(config, b), mesh, optimizer=True)
            for part_got, part_want in zip(got.parts, want.parts):
                for kind, (buffer, _) in part_want.buffers().items():
                    assert torch.equal(part_got.buffers()[kind][0], buffer), (kind, rank)
            assert int(got.parts[0].count) == 7
            held = sum(
                buf.numel() * buf.element_size()
                for part in got.parts
                for buf, _ in part.buffers().values()
            )
            assert ckpt.cell_bytes_read - before <= 1.5 * held, (
                ckpt.cell_bytes_read - before,
                held,
            )


def test_a_replicated_block_is_written_once_whether_or_not_its_replicas_share_the_writing(tmp_path):
    """dp 2 x tp 2 in bf16 with ZeRO-1: the cells of all files together hold each element of each
    global tensor once (a norm weight is held by all 4 ranks, a qkv block by 2); fully parallel, the
    replicas share the writing of the weights, otherwise the first data-parallel rank writes them
    (every rank writes its own slices)."""
    layout, spread = Layout(tp=2, dp=2, sharding="optim"), {}
    for fully in (True, False):
        path = save(tmp_path / str(fully), BASE, layout, torch.bfloat16, fully)
        with checkpoint.Checkpoint.open(path) as ckpt:
            for name, entries in ckpt.entries.items():
                stored = sum(
                    e.grid.cell(i).numel
                    for e in entries
                    for i in range(e.first, e.first + len(e.crcs))
                )
                assert stored == math.prod(ckpt.shape(name)), name
        sizes = [(path / f"rank_0000{r}.safetensors").stat().st_size for r in range(4)]
        spread[fully] = max(sizes) - min(sizes)
        assert fully or (sizes[2] < sizes[0] and sizes[3] < sizes[1]), sizes
    assert spread[True] < spread[False] / 2, spread
