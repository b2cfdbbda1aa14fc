"""Layout invariance of GPT-OSS's pieces with default flags otherwise (dropout 0.1 included): a
GPT-OSS-shaped model (learnable attention sinks, sliding windows on every other layer, the clamped
quick-GEGLU with its offset, biased experts and router, YaRN by --enable-gpt-oss) gives one rank's
loss curve and load_balancing_loss within 1e-5 over 20 iterations at tp 2 with sp, pp 2 with virtual
stages, ep 2, cp 2 (the windowed and sink layers gather the whole sequence's keys whatever the comm
type), dp 2 with the distributed optimizer, with packed documents, and a checkpoint saved at one
layout resumes at another on its curve."""

import pytest

from harness.runner import DROPOUT, run_recipe
from harness.layouts import TP2_SP
from harness.layouts import PP2_VIRTUAL, assert_same
from harness import layouts

OSS = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    "0.5",
    "--softmax-type",
    "learnable",
    "--window-size",
    "5,0",
    "--window-attn-skip-freq",
    "2",
    "--enable-gpt-oss",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "32",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-aux-loss-coeff",
    "1e-2",
    *DROPOUT,
]
KEYS = ("lm_loss", "load_balancing_loss")
# tests/parallel/test_parallel_gpt.py checks the GPT-OSS pieces under tp in the default suite
LAYOUTS = layouts.rows(
    ["cp2", "tp2_sp", "pp2_virtual", "ep2", "cp2_a2a", "dp2_zero1", "ep2_tp2_sp_zero1"],
    fast=("cp2"),
)


def curves(tmp_path, name, nproc, flags):
    records, _ = run_recipe(tmp_path, name, nproc, [*OSS, *flags])
    return {key: [r[key] for r in records if "lm_loss" in r] for key in KEYS}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return curves(tmp_path_factory.mktemp("oss"), "single", 1, [])


@pytest.mark.parametrize("name, nproc, flags", LAYOUTS)
def test_gpt_oss_curves_equal_one_ranks(tmp_path, single, name, nproc, flags):
    assert_same(curves(tmp_path, name, nproc, flags), single)


@pytest.mark.slow
def test_gpt_oss_with_packed_documents_at_cp2_x_pp2_equals_one_rank(tmp_path):
    documents = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    flags = ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", *documents]
    assert_same(curves(tmp_path, "other", 4, flags), curves(tmp_path, "one", 1, documents))


@pytest.mark.slow
def test_gpt_oss_saved_at_pp2_resumes_at_tp2_on_its_curve(tmp_path, single):
    ckpt = str(tmp_path / "ckpt")
    curves(
        tmp_path,
        "first",
        2,
        [
            *PP2_VIRTUAL,
            "--use-distributed-optimizer",
            "--save",
            ckpt,
            "--train-iters",
            "10",
            "--lr-decay-iters",
            "20",
        ],
    )
    records, stdout = run_recipe(tmp_path, "second", 2, [*OSS, *TP2_SP, "--load", ckpt])
    assert "resumed from" in stdout
    got = {key: [r[key] for r in records if "lm_loss" in r] for key in KEYS}
    assert_same(got, {key: values[10:] for key, values in single.items()}, iterations=10)
