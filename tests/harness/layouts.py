"""Flag sets of layouts and model variants that several invariance tests share (multi-latent
attention, tp 2 with sequence parallelism, pp 2 with virtual stages), and assert_same, their
comparison of two runs' loss curves."""

MLA = [
    "--multi-latent-attention",
    "--position-embedding-type",
    "rope",
    "--q-lora-rank",
    "24",
    "--kv-lora-rank",
    "16",
    "--qk-head-dim",
    "8",
    "--qk-pos-emb-head-dim",
    "8",
    "--v-head-dim",
    "12",
    "--qk-layernorm",
    "--normalization",
    "RMSNorm",
    "--rotary-scaling-factor",
    "4",
    "--mscale",
    "1.0",
    "--mscale-all-dim",
    "1.0",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--ffn-hidden-size",
    "32",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-topk-scaling-factor",
    "2.5",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-aux-loss-coeff",
    "1e-3",
    "--moe-shared-expert-intermediate-size",
    "8",
    "--moe-layer-freq",
    "([0]+[1]*3)",
    "--moe-ffn-hidden-size",
    "8",
    "--moe-router-dtype",
    "fp32",
]


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


PP2_VIRTUAL = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]


def assert_same(got, want, iterations=20):
    for key in want:
        assert len(got[key]) == len(want[key]) == iterations, key
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], want[key])
