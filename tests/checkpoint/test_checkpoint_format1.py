"""Checkpoints written before format 2 (fmeg to 2026-11-24: whole-rank safetensors files,
distributed-optimizer state as flat slices, a sha256 per file) still load: resumed at one rank they
continue exactly as that fmeg continued them. The fixtures (tests/fixtures/fmeg_format1) were
written by the last format-1 fmeg; its command and the curves it resumed are in
resumed_at_one_rank.json."""

import json
import shutil

import pytest
import torch

from fmeg import checkpoint
from fmeg.models import gpt
from fmeg.parallel.mesh import Mesh
from fmeg.training.checkpoint_state import read_params
from fmeg.parallel.layout import Layout
from fmeg.training.run_state import read_state
from harness.runner import run_recipe
from harness.checkpoints import _Cfg, one_rank_state
from harness.paths import FIXTURES

DATA = FIXTURES / "fmeg_format1"
RECORDED = json.loads((DATA / "resumed_at_one_rank.json").read_text())
SMALL = [
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--make-vocab-size-divisible-by",
    "8",
    "--seq-length",
    "16",
    "--log-interval",
    "100",
    "--lr-warmup-iters",
    "2",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "64",
    "--num-layers",
    "2",
    "--train-iters",
    "6",
    "--lr-decay-iters",
    "6",
    "--log-params-norm",
]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]


@pytest.mark.parametrize(
    "name, directory, flags",
    [("dense", "dense_tp2_dp2_zero_bf16", ["--bf16"]), ("moe", "moe_cp2_ep2_zero", MOE)],
)
def test_a_format1_checkpoint_resumes_as_the_fmeg_that_wrote_it_resumed_it(
    tmp_path, name, directory, flags
):
    """tp 2 x dp 2 with bf16 and ZeRO-1 slices, and cp 2 x ep 2 experts with ZeRO-1 slices of their
    own."""
    shutil.copytree(DATA / directory, tmp_path / directory)
    records, stdout = run_recipe(
        tmp_path, name, 1, [*flags, "--load", str(tmp_path / directory)], common=SMALL
    )
    assert "resumed from" in stdout and "iteration 3" in stdout
    # written before routers took --add-bias-linear's bias: resumed without one, and said so
    if name == "moe":
        assert "its routers have no bias (an fmeg before they took --add-bias-linear's" in stdout
    got = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in got] == [r["iteration"] for r in RECORDED[name]]
    # bitwise where the fixtures were written; CI's CPU took another float32 summation order at one
    # step of the bf16 run (4.0916500 against 4.0916505), so the curve is compared within rounding,
    # not bitwise
    assert [r["lm_loss"] for r in got] == pytest.approx(
        [r["lm_loss"] for r in RECORDED[name]], rel=1e-6
    )
    # the norm's float32 reduction order follows the thread count (OMP_NUM_THREADS), so not bitwise
    assert [r["params_norm"] for r in got] == pytest.approx(
        [r["params_norm"] for r in RECORDED[name]], rel=1e-7
    )


def test_a_damaged_format1_file_is_refused_naming_it(tmp_path):
    shutil.copytree(DATA / "dense_tp2_dp2_zero_bf16", tmp_path / "ck")
    shard = tmp_path / "ck" / "iter_0000003" / "rank_00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0xFF
    shard.write_bytes(bytes(data))
    with checkpoint.Checkpoint.open(checkpoint.latest(tmp_path / "ck")) as ckpt:
        config = gpt.GPTConfig(**ckpt.meta["model"])
        # the bf16 weights are in ranks 0 and 1's files; rank 2's holds distributed-optimizer slices
        # only
        read_params(ckpt, config, Layout(), Mesh.single(), dtype=torch.bfloat16)
        with pytest.raises(
            checkpoint.CheckpointError, match=r"rank_00002\.safetensors: checksum mismatch"
        ):
            read_state(ckpt, one_rank_state(config), _Cfg(config), Mesh.single(), optimizer=True)
