"""Megatron-LM's distributed-optimizer state in: a run of megatron-core itself (its GPTModel,
DistributedDataParallel and DistributedOptimizer on CPU with gloo, at dp 2: tests/harness/
megatron_core_run.py train), saved as Megatron-LM saves by default (dp_reshardable: flat buckets)
and with --dist-ckpt-optim-fully-reshardable, loads into fmeg with Adam's moments, fp32 master
weights and step, bitwise as megatron-core's own load restores them, and fmeg's continuation at
tp 1 and at tp 2 gives megatron-core's own continuation's losses within 1e-5. A tp 2 x dp 2 run
of the gated, untied llama saved both ways reads the same state from both."""

import sys

import pytest
import torch

pytest.importorskip("megatron.core.dist_checkpointing")

from fmeg import tree  # noqa: E402
from fmeg.interop.megatron import MegatronCheckpoint, bucket_layout, gpt_keys  # noqa: E402
from fmeg.parallel.layout import Layout  # noqa: E402
from fmeg.parallel.mesh import Mesh  # noqa: E402
from fmeg.parallel.spmd import run_threads  # noqa: E402
from fmeg.training.checkpoint_state import placements, read_params, regions  # noqa: E402
from fmeg.training.parallel_step import init_state, local_shapes, train_iteration  # noqa: E402
from fmeg.training.run_state import read_state  # noqa: E402
from fmeg.training.step_settings import StepSettings  # noqa: E402
from harness.megatron_families import CONFIGS  # noqa: E402
from harness.paths import TESTS  # noqa: E402
from harness.runner import run_group  # noqa: E402

sys.path.insert(0, str(TESTS / "harness"))
from megatron_core_run import LR, batches  # noqa: E402

PROGRAM = str(TESTS / "harness" / "megatron_core_run.py")
SAVED_AT, MORE = 4, 3
# the harness's models with Megatron's whole vocabulary of 128 (no padding rows, so that both
# softmaxes see the same logits): gpt2 (tied, biases), llama (gated MLP, RMSNorm, untied, no
# biases), gpt2_moe (4 experts with biases, a biased router)
CONFIG, LLAMA, MOE = (CONFIGS[f].replace(vocab_size=128) for f in ("gpt2", "llama", "gpt2_moe"))


class RunConfig:
    """What read_state reads of a RunConfig."""

    def __init__(self, layout, config=CONFIG):
        self.model, self.layout = config, layout
        self.checkpoint = type("C", (), {"fully_parallel_load": False})()


def torchrun(nproc: int, *args: str) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    out = run_group([*launcher, f"--nproc-per-node={nproc}", PROGRAM, *args], timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.fixture(scope="module", params=["dp_reshardable", "fully_reshardable"])
def megatron(tmp_path_factory, request):
    """(the checkpoint's directory, megatron-core's own state after loading it, its losses of
    the MORE iterations after it), the optimizer's state saved as request.param lays it out."""
    root = tmp_path_factory.mktemp("megatron")
    torchrun(2, "train", str(root / "ck"), "gpt2", "1", "1", "1", str(SAVED_AT), request.param)
    directory = root / "ck" / f"iter_{SAVED_AT:07d}"
    out = root / "continued.pt"
    torchrun(1, "continue", str(directory), "gpt2", str(MORE), str(out), request.param)
    return directory, torch.load(out, weights_only=True)


def loaded(mesh, layout, directory, config=CONFIG):
    state = init_state(local_shapes(config, layout, mesh), config, layout, mesh, device="cpu")
    with MegatronCheckpoint.open(directory, config) as ckpt:
        assert ckpt.holds_optimizer_state(), ckpt.optimizer_unread()
        read_state(ckpt, state, RunConfig(layout, config), mesh, optimizer=True)
    return state


def continued(mesh, layout, directory, iterations):
    """This rank's losses of `iterations` steps after the checkpoint (None off the last stage)."""
    state = loaded(mesh, layout, directory)
    settings = StepSettings(lr=LR, weight_decay=0.01, clip_grad=1.0)
    losses = []
    for i in range(iterations):
        tokens, labels = batches(SAVED_AT + i)
        mb = [{"tokens": tokens, "labels": labels}]
        m = train_iteration(state, mb, config=CONFIG, layout=layout, mesh=mesh, settings=settings)
        losses.append(None if m["loss"] is None else float(m["loss"]))
    return losses


def test_megatrons_moments_and_master_weights_load_bitwise(megatron):
    """Every box of fmeg's mu, nu and master weights at tp 1 equals megatron-core's own loaded
    exp_avg, exp_avg_sq and param (fp32: fmeg's weights are its master)."""
    directory, theirs = megatron
    assert theirs["steps"] == [float(SAVED_AT)]
    layout, mesh = Layout(), Mesh.single()
    state = loaded(mesh, layout, directory)
    assert int(state.count) == SAVED_AT
    keys = {"mu": "exp_avg", "nu": "exp_avg_sq", "params": "param"}
    checked = 0
    for region in regions(state, placements(state, CONFIG, layout, mesh), tuple(keys)):
        src = gpt_keys.source(region.placement.name, False)
        key = f"optimizer.state.{keys[region.kind]}.{src.keys[0]}"
        whole = theirs["moments"][key]
        whole = whole[src.layer] if src.layer is not None else whole
        box = tuple(slice(o, o + n) for o, n in zip(region.box.offset, region.box.shape))
        assert torch.equal(region.view, whole[box]), (region.kind, region.placement.name)
        checked += 1
    assert checked == 3 * len(list(tree.items(state.params)))


@pytest.mark.parametrize("tp", [1, 2])
def test_fmeg_continues_as_megatron_core_continues(megatron, tp):
    directory, theirs = megatron
    layout = Layout(tp=tp)
    per_rank = run_threads(tp, continued, layout, directory, MORE, tp=tp)
    got = per_rank[0]
    want = theirs["losses"]
    assert len(got) == len(want) == MORE
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def test_the_runner_resumes_megatrons_adam_state(megatron, tmp_path):
    """`--load` of Megatron's directory under recipes.gpt_pretrain, its flags those of the run:
    Adam's state is taken (the start line says from which layout), no warning."""
    directory, _ = megatron
    flags = [*GPT2_FLAGS, "--vocab-size", "128", "--train-iters", str(SAVED_AT + 1)]
    run = run_group(
        [sys.executable, "-m", "recipes.gpt_pretrain", *flags, "--load", str(directory.parent)]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    saved = "dp_reshardable" if "dp_reshardable" in _sharding(directory) else "fully_reshardable"
    assert f"Adam's state at step {SAVED_AT}, saved {saved})" in run.stdout, run.stdout[-2000:]
    assert "warning" not in run.stdout + run.stderr.replace("UserWarning", "")


def _sharding(directory) -> str:
    with MegatronCheckpoint.open(directory, CONFIG) as ckpt:
        return ckpt.sharding()


def test_buckets_that_cannot_be_placed_are_named(megatron, monkeypatch):
    """A dp_reshardable state whose parameters are not placed (a model this reader does not lay
    out, or an order the buckets do not hold) is not read, and says why in a few words."""
    directory, _ = megatron
    if _sharding(directory) != "dp_reshardable":
        pytest.skip("the per-parameter state needs no placing")
    with MegatronCheckpoint.open(directory, CONFIG) as ckpt:
        ckpt.args.mtp_num_layers = 1
        assert not ckpt.holds_optimizer_state()
        assert "not placed: its model uses --mtp-num-layers" in ckpt.optimizer_unread()
    for name, order in bucket_layout.LAYER_ORDERS.items():
        monkeypatch.setitem(bucket_layout.LAYER_ORDERS, name, order[::-1])
    with MegatronCheckpoint.open(directory, CONFIG) as ckpt:
        assert not ckpt.holds_optimizer_state()
        assert "match neither the transformer_engine nor the local layer spec's" in (
            ckpt.optimizer_unread()
        )


@pytest.fixture(scope="module")
def one_rank_saves(tmp_path_factory):
    """megatron-core's gpt2 trained on one rank, saved dp_reshardable and as --ckpt-format torch
    (with distrib_optim.pt): ROOT/<sharding>/iter_NNNNNNN."""
    root = tmp_path_factory.mktemp("one_rank")
    torchrun(1, "train", str(root), "gpt2", "1", "1", "1", str(SAVED_AT), "dp_reshardable,legacy")
    return root


def test_a_legacy_directory_stays_described_as_one_once_its_buckets_are_read(one_rank_saves):
    """The start line's words for a --ckpt-format torch directory with its distributed optimizer
    (issue 67: once its buckets were decoded it was "torch_dist ... saved None")."""
    with MegatronCheckpoint.open(one_rank_saves / "legacy" / f"iter_{SAVED_AT:07d}", CONFIG) as ck:
        assert ck.holds_optimizer_state() and ck.optimizer_step() == SAVED_AT
        assert ck.describe() == "a Megatron --ckpt-format torch checkpoint (tp 1, pp 1, ep 1)"
        assert ck.sharding() == "distrib_optim.pt" and ck.meta["iteration"] == SAVED_AT


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_in_the_optimizers_objects_is_named(one_rank_saves, tmp_path):
    """os.system in the distributed optimizer's saved param groups (a ShardedObject's bytes) runs
    nothing and is refused in one line saying so (issue 67: it read as "no optimizer state fmeg
    reads", with Megatron's advice to resave)."""
    import dataclasses
    import io
    import pickle
    import shutil

    from fmeg.checkpoint import CheckpointError

    directory = tmp_path / f"iter_{SAVED_AT:07d}"
    shutil.copytree(one_rank_saves / "dp_reshardable" / directory.name, directory)
    marker = tmp_path / "ran"
    # the object's bytes replaced: the crafted ones appended to its file, .metadata pointed there
    # (this test's own files: read back with pickle)
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    key = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info, crafted = metadata.storage_data[index], io.BytesIO()
    torch.save(_RunsCode(marker), crafted)
    offset = (directory / info.relative_path).stat().st_size
    with open(directory / info.relative_path, "ab") as f:
        f.write(crafted.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        info, offset=offset, length=len(crafted.getvalue())
    )
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    with MegatronCheckpoint.open(directory, CONFIG) as ck:
        with pytest.raises(CheckpointError) as e:
            ck.holds_optimizer_state()
    assert (
        f"({key}): refused, it holds a pickle that would run code (posix.system), which fmeg "
        "refuses to run; nothing was run"
    ) in str(e.value)
    assert not marker.exists()


@pytest.mark.slow  # 35 s each: megatron-core trains on 4 ranks and saves three ways
@pytest.mark.parametrize("bucket_size", [None, 20000], ids=["one-bucket", "buckets-of-20000"])
def test_buckets_at_tp2_hold_what_the_per_parameter_state_holds(tmp_path, monkeypatch, bucket_size):
    """megatron-core's llama at tp 2 x dp 2 saved dp_reshardable (two model-parallel ranks'
    buckets, each gated fc1 [gate_r; up_r]) and as --ckpt-format torch with distrib_optim.pt (the
    buckets gathered, their padding dropped), from the same state: fmeg reads every box of mu, nu
    and the master weights the same from both, at tp 1 and at tp 2, the masters its weights. In
    one bucket, the same as its fully_reshardable save. With --overlap-grad-reduce
    --ddp-bucket-size 20000 each rank's state spans four buckets (there megatron-core 0.16's
    fully_reshardable save writes master weights that are not its weights: not compared)."""
    if bucket_size is not None:
        monkeypatch.setenv("BUCKET_SIZE", str(bucket_size))
    shardings = ("dp_reshardable", "legacy", "fully_reshardable")
    torchrun(4, "train", str(tmp_path), "llama", "2", "1", "1", str(SAVED_AT), ",".join(shardings))
    compared = shardings if bucket_size is None else shardings[:2]
    for layout, world in ((Layout(), 1), (Layout(tp=2), 2)):

        def read_each(mesh, layout):
            return [
                loaded(mesh, layout, tmp_path / s / f"iter_{SAVED_AT:07d}", LLAMA) for s in compared
            ]

        for first, *others in run_threads(world, read_each, layout, tp=layout.tp):
            assert int(first.count) == SAVED_AT
            for state, name in zip(others, compared[1:]):
                assert int(state.count) == SAVED_AT
                # the flat buffers: every leaf's moments and master weights
                for kind in ("mu", "nu", "weights"):
                    a, b = getattr(state, kind), getattr(first, kind)
                    assert a.abs().sum() > 0 and torch.equal(a, b), (name, layout, kind)
    # fp32: the masters read from the buckets are the model's weights, every element
    for name in shardings[:2]:
        with MegatronCheckpoint.open(tmp_path / name / f"iter_{SAVED_AT:07d}", LLAMA) as ckpt:
            assert ckpt.holds_optimizer_state()
            weights, main = (
                dict(tree.items(read_params(ckpt, LLAMA, Layout(), Mesh.single(), kind=k)[0]))
                for k in ("params", "main")
            )
        assert weights.keys() == main.keys()
        for path, w in weights.items():
            assert torch.equal(main[path], w), (name, path)


@pytest.mark.slow  # 30 s: megatron-core trains on 2 ranks and saves twice
def test_experts_buckets_hold_what_the_per_parameter_state_holds(tmp_path):
    """megatron-core's mixture of experts at ep 2 (its chained optimizer: the dense parameters'
    buckets and each expert rank's, under chained_0. and chained_1.) saved dp_reshardable and
    fully_reshardable (older saves' prefixed keys) from the same state: fmeg reads every box of
    mu, nu and the master weights the same from both, on one rank and at ep 2."""
    shardings = ("dp_reshardable", "fully_reshardable")
    torchrun(
        2, "train", str(tmp_path), "gpt2_moe", "1", "1", "2", str(SAVED_AT), ",".join(shardings)
    )
    kinds = ("mu", "nu", "params")
    for layout, world in ((Layout(), 1), (Layout(dp=2, ep=2), 2)):

        def boxes_of_each(mesh, layout):
            out = []
            for name in shardings:
                state = loaded(mesh, layout, tmp_path / name / f"iter_{SAVED_AT:07d}", MOE)
                assert int(getattr(state, "dense", state).count) == SAVED_AT
                found = regions(state, placements(state, MOE, layout, mesh), kinds)
                out.append({(r.kind, r.placement.name, r.box): r.view.clone() for r in found})
            return out

        for buckets, whole in run_threads(world, boxes_of_each, layout, ep=layout.ep):
            assert buckets.keys() == whole.keys() and len(buckets) > 0
            assert any("experts" in name for _, name, _ in buckets)
            for where, t in buckets.items():
                assert torch.equal(t, whole[where]), (layout, where)


GPT2_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "256",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "127",
    "--make-vocab-size-divisible-by",
    "128",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--use-distributed-optimizer",
]


@pytest.mark.slow  # 20 s: fmeg trains at dp 2, exports, megatron-core loads
def test_exported_adam_state_is_what_megatron_core_loads(tmp_path):
    """fmeg trains 3 iterations at dp 2 with ZeRO-1 and saves; export-megatron writes the weights
    and Adam's state; megatron-core's own load of them (model and distributed optimizer) holds
    fmeg's moments and master weights bitwise, and its step."""
    from fmeg import checkpoint
    from fmeg.interop.megatron.export import megatron_tensors
    from fmeg.training.checkpoint_state import read_params, saved_count

    ckpt, out = str(tmp_path / "fmeg"), str(tmp_path / "megatron")
    flags = [*GPT2_FLAGS, "--train-iters", "3", "--save", ckpt, "--save-interval", "3"]
    launcher = [sys.executable, "-m", "fmeg.launch", "--nproc-per-node", "2"]
    trained = run_group([*launcher, "-m", "recipes.gpt_pretrain", *flags])
    assert trained.returncode == 0, trained.stderr[-3000:]
    convert = [sys.executable, "-m", "recipes.convert_checkpoint", "export-megatron"]
    exported = run_group([*convert, "--load", ckpt, "--save", out])
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "with Adam state" in exported.stdout and "--use-distributed-optimizer" in exported.stdout
    dumped = tmp_path / "loaded.pt"
    torchrun(1, "continue", f"{out}/iter_0000003", "gpt2", "0", str(dumped))
    loaded = torch.load(dumped, weights_only=True)
    assert loaded["steps"] == [3.0]
    theirs = loaded["moments"]
    config = CONFIG.replace(vocab_size=127)
    with checkpoint.Checkpoint.open(checkpoint.latest(ckpt)) as saved:
        assert saved_count(saved) == 3
        for kind, name in (("mu", "exp_avg"), ("nu", "exp_avg_sq"), ("params", "param")):
            mine = read_params(saved, config, Layout(), Mesh.single(), kind=kind)[0]
            for key, t in megatron_tensors(mine, config, 128).items():
                assert torch.equal(theirs[f"optimizer.state.{name}.{key}"], t), (kind, key)


# megatron-core moves a tied model's last-stage output copy to CUDA: gpt2 at pp 1
@pytest.mark.slow  # 75 s: megatron-core saves each model twice on 2 and 4 ranks
@pytest.mark.parametrize("family, pp", [("llama", 2), ("gpt2", 1)])
def test_legacy_torch_format_reads_the_weights_torch_dist_holds(tmp_path, family, pp):
    """The same megatron-core model (seed 1234, at tp 2 x pp) saved both ways: --ckpt-format
    torch (each rank its state_dict_for_save_checkpoint, torch.save'd as Megatron-LM saves it;
    llama's gated fc1 split per rank as [gate_r; up_r]) and torch_dist; fmeg reads the same
    weights, bitwise, from both."""
    from fmeg import checkpoint
    from fmeg.config.checkpoint_args import megatron_model
    from fmeg.interop.megatron import saved_args
    from fmeg.training.checkpoint_state import read_params

    legacy, dist = tmp_path / "legacy", tmp_path / "dist"
    torchrun(2 * pp, "save_legacy", str(legacy), family, "2", str(pp), "3")
    torchrun(2 * pp, "save", str(dist), family, "2", str(pp), "1", "3")
    # the model the legacy files' own args describe
    config, read = megatron_model(saved_args(checkpoint.latest(legacy))), {}
    for name, root in (("legacy", legacy), ("dist", dist)):
        with MegatronCheckpoint.open(checkpoint.latest(root), config) as ckpt:
            ckpt.check(config)
            read[name] = read_params(ckpt, config, Layout(), Mesh.single())[0]
            assert ckpt.meta["iteration"] == 3
            if name == "legacy":
                assert f"--ckpt-format torch checkpoint (tp 2, pp {pp}" in ckpt.describe()
    pairs = zip(tree.items(read["legacy"]), tree.items(read["dist"]))
    for (path, a), (_, b) in pairs:
        assert torch.equal(a, b), path
