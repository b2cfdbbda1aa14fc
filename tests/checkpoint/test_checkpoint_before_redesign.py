"""Checkpoints written by fmeg before issue 50's redesign (tests/fixtures/before_redesign, with
write.py's command) resume on the curve that fmeg resumed them on: a dense GPT at tp 2 x pp 2 with
bf16 and the distributed optimizer, and MLA + experts + an MTP depth at dp 2 x ep 2. Bitwise where
torch's version and its CPU kernels (harness.cpu_kernels) are the recording's (the gradient norm,
accumulated in fp64 since, within fp32's rounding); elsewhere within float32 rounding: other
kernels block and accumulate in another order (CI, on a machine that also calls itself "AMD EPYC",
once put iteration 6's bf16 loss 6e-8 off).

The recording kept only the CPU's name; curves.json's "kernels" was added after it: the
fingerprint of a machine that reproduces all six losses bit for bit (an AVX-512 Xeon with
avx512_bf16, on which the curves' bits come back exactly, run after run)."""

import json
import shutil

import pytest
import torch

from harness.cpu_kernels import cpu_kernels
from harness.runner import run_recipe
from harness.paths import FIXTURES

DATA = FIXTURES / "before_redesign"
CURVES = json.loads((DATA / "curves.json").read_text())


@pytest.mark.parametrize("name", ["dense_tp2_pp2_bf16_zero", "mla_moe_mtp_ep2"])
def test_a_checkpoint_from_before_the_redesign_resumes_on_its_curve(tmp_path, name):
    run = CURVES[name]
    shutil.copytree(DATA / name, tmp_path / name)
    flags = [*run["flags"], "--load", str(tmp_path / name)]
    records, stdout = run_recipe(tmp_path, "log", run["nproc"], flags, common=[])
    assert "resumed from" in stdout and "iteration 3" in stdout
    want = run["resumed"]
    got = [{k: r[k] for k in w} for r, w in zip([r for r in records if "lm_loss" in r], want)]
    assert [r["iteration"] for r in got] == [w["iteration"] for w in want] == [4, 5, 6]
    if (CURVES["kernels"], CURVES["torch"]) == (cpu_kernels(), torch.__version__):
        # the gradient norm is accumulated in fp64 since issue 54 (it was recorded from fp32
        # norms of the slices): the same clip, the losses bitwise, the norm within fp32's rounding
        norms = [(g.pop("grad_norm"), w["grad_norm"]) for g, w in zip(got, want)]
        assert got == [{k: v for k, v in w.items() if k != "grad_norm"} for w in want]
        assert all(g == pytest.approx(w, rel=1e-7) for g, w in norms)
    else:
        for g, w in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6)
