"""Checkpoints the tests write and break: a one-rank state saved whole (save_one), a disk that
fills at a chosen byte (full_disk_at), the mesh of a layout (mesh_of)."""

from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.training.checkpoint_state import save_single_rank
from fmeg.parallel.layout import Layout
from fmeg.training.parallel_step import init_state, shard_params
from fmeg.checkpoint import safetensors_file


CONFIG = gpt.GPTConfig.gpt2(
    vocab_size=64, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4
)


def one_rank_state(config=CONFIG, seed=0):
    mesh, layout = Mesh.single(), Layout()
    return init_state(
        shard_params(gpt.init(config, seed), config, layout, mesh), config, layout, mesh
    )


def save_one(root, iteration, config=CONFIG):
    state = one_rank_state(config)
    state.set_count(iteration)
    return save_single_rank(root, iteration, state, config, {}), state.params, state


class _Cfg:  # what read_state reads of a RunConfig
    def __init__(self, config):
        self.model, self.layout = config, Layout()
        self.checkpoint = type("C", (), {"fully_parallel_load": False})()


def full_disk_at(monkeypatch, iteration: int):
    """Make the checkpoint writer report ENOSPC for iteration's files; returns the real writer."""
    import errno

    real_write = safetensors_file.write

    def full_disk(path, tensors, metadata=None):
        if f"iter_{iteration:07d}" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(safetensors_file, "write", full_disk)
    return real_write


def mesh_of(layout: Layout, rank: int) -> Mesh:
    world = layout.tp * layout.pp * layout.cp * layout.dp
    return Mesh.build(
        rank,
        world,
        lambda ranks: None,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        etp=layout.expert_tp,
    )
