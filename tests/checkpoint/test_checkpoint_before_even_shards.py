"""A checkpoint written by fmeg before FSDP's even per-unit shards (tests/fixtures/
before_even_shards, with write.py's command: Megatron-FSDP's optim_grads_params at dp 4, when each
rank owned a contiguous slice of the flat buffers) resumes on the curve that fmeg resumed it on, at
its layout and at ZeRO-1 on dp 2: checkpoints hold each tensor by name, whatever slices wrote
them. Within 1e-5 (the data-parallel sums now reduce-scatter, where they reduced to one rank)."""

import json
import shutil

import pytest

from harness.paths import FIXTURES
from harness.runner import run_recipe

DATA = FIXTURES / "before_even_shards"
CURVES = json.loads((DATA / "curves.json").read_text())
ZERO1_DP2 = (2, ["--use-distributed-optimizer"])


@pytest.mark.parametrize("layout", ["same", "zero1_dp2"])
def test_a_checkpoint_of_the_old_fsdp_slices_resumes_on_its_curve(tmp_path, layout):
    run = CURVES["fsdp_dp4"]
    shutil.copytree(DATA / "fsdp_dp4", tmp_path / "ckpt")
    flags = [*run["flags"], "--load", str(tmp_path / "ckpt")]
    nproc = run["nproc"]
    if layout == "zero1_dp2":
        fsdp = flags.index("--use-megatron-fsdp")
        flags = flags[:fsdp] + flags[fsdp + 3 :] + ZERO1_DP2[1]
        nproc = ZERO1_DP2[0]
    records, stdout = run_recipe(tmp_path, "log", nproc, flags, common=[])
    assert "resumed from" in stdout and "iteration 3" in stdout
    got = [r for r in records if "lm_loss" in r]
    want = run["resumed"]
    assert [r["iteration"] for r in got] == [w["iteration"] for w in want] == [4, 5, 6]
    for g, w in zip(got, want):
        assert g["lm_loss"] == pytest.approx(w["lm_loss"], rel=1e-5)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
