"""The one table of layouts that every feature's invariance rows use: each row a name, its world
size and its flags. A feature's test picks the rows that apply to it (rows()) and runs each against
its one-rank reference with its own model flags; the names say what the layout is (tp2_sp: tensor
parallelism 2 with sequence parallelism; ep2: experts over 2 ranks; zero1: the distributed
optimizer; cp2_a2a: context parallelism 2 by all-to-all; ...)."""

import pytest

TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2_VIRTUAL = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
CP2 = ["--context-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
# a model with experts and a gated MLP, grouped queries and an untied output layer (the optimizer
# and FP8 rows')
EXPERTS_MODEL = [
    "--swiglu",
    "--num-query-groups",
    "2",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-layer-freq",
    "([0]+[1]*3)",
    "--untie-embeddings-and-output-weights",
]
ZERO1 = ["--use-distributed-optimizer"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
HYBRID2 = ["--num-distributed-optimizer-instances", "2"]
# 1 decoder layer on the first pipeline rank, the other 3 on the next
FIRST1 = ["--decoder-first-pipeline-num-layers", "1"]
# pp 2 x 3 virtual stages of 0, 1, 2, 0, 1 and 0 decoder layers: the embedding alone, an empty
# stage, the loss alone
UNEVEN_LAYOUT = ["--pipeline-model-parallel-layout", "E|t|tt||t|L"]
A2A = ["--moe-token-dispatcher-type", "alltoall"]
# two virtual stages on each of 2 pipeline ranks in a V (stages 0 and 3 on rank 0, 1 and 2 on 1)
PP2_V = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
ZB_V = [*PP2_V, "--pipeline-schedule", "zero_bubble_v"]
DUALPIPE_V = [*PP2_V, "--pipeline-schedule", "dualpipe_v"]

# multi-latent attention with experts: the model of the MLA and MTP rows
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

TABLE: dict[str, tuple[int, list[str]]] = {
    "cp2_p2p": (2, [*CP2]),
    "cp2_all_gather": (2, [*CP2, "--cp-comm-type", "all_gather"]),
    "cp2_a2a": (2, [*CP2, "--cp-comm-type", "a2a"]),
    "cp4": (4, ["--context-parallel-size", "4"]),
    "cp4_a2a_p2p": (
        4,
        [
            "--context-parallel-size",
            "4",
            "--cp-comm-type",
            "a2a+p2p",
            "--hierarchical-context-parallel-sizes",
            "2",
            "2",
        ],
    ),
    "cp2_tp2_sp": (4, [*CP2, *TP2_SP]),
    "cp2_pp2_virtual": (4, [*CP2, *PP2_VIRTUAL]),
    "cp2_dp2_zero1": (4, [*CP2, *ZERO1]),
    "cp2_recompute_selective": (2, [*CP2, "--recompute-granularity", "selective"]),
    "cp2_per_token": (2, [*CP2, "--calculate-per-token-loss"]),
    "cp2_per_layer_types": (2, [*CP2, "--cp-comm-type", "p2p", "a2a", "all_gather", "p2p"]),
    "cp2_compiled": (2, [*CP2, "--compile"]),
    "cp2_per_layer_types_compiled_recomputed": (
        2,
        [
            *CP2,
            "--compile",
            "--cp-comm-type",
            "p2p",
            "a2a",
            "all_gather",
            "p2p",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ),
    "tp2_sp": (2, [*TP2_SP]),
    "pp2_virtual": (2, [*PP2_VIRTUAL]),
    "dp2_zero1": (2, [*ZERO1]),
    "tp2_pp2_recompute": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--recompute-granularity",
            "selective",
        ],
    ),
    "compiled": (1, ["--compile"]),
    "cp2": (2, [*CP2]),
    "ep2": (2, [*EP2]),
    "ep2_tp2_sp_zero1": (4, [*TP2_SP, *EP2, *ZERO1]),
    "cp2_allgather": (2, [*CP2, "--cp-comm-type", "all_gather"]),
    "recompute_selective_compiled": (1, ["--recompute-granularity", "selective", "--compile"]),
    "recompute_modules_tp2_sp_compiled": (
        2,
        [
            *TP2_SP,
            "--recompute-activations",
            "--recompute-modules",
            "mla_up_proj",
            "moe",
            "mlp",
            "layernorm",
            "core_attn",
            "moe_act",
            "shared_experts",
            "--compile",
        ],
    ),
    "ep4": (4, ["--expert-model-parallel-size", "4"]),
    "ep2_tp2_sp": (4, [*EP2, *TP2_SP]),
    "ep2_pp2_virtual": (4, [*EP2, *PP2_VIRTUAL]),
    "ep2_dp2": (4, [*EP2]),
    "ep2_dp2_zero1": (4, [*EP2, *ZERO1]),
    "ep2_tp2_sp_etp1": (4, [*EP2, *TP2_SP, "--expert-tensor-parallel-size", "1"]),
    "tp2_sp_etp1": (2, [*TP2_SP, "--expert-tensor-parallel-size", "1"]),
    "ep2_tp2_sp_etp1_zero1": (4, [*EP2, *TP2_SP, "--expert-tensor-parallel-size", "1", *ZERO1]),
    "ep2_tp2_sp_compiled": (4, [*EP2, *TP2_SP, "--compile"]),
    "recompute_full": (
        1,
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ),
    "recompute_selective": (2, [*EP2, "--recompute-granularity", "selective"]),
    "ep2_alltoall": (2, [*EP2, *A2A]),
    "ep4_alltoall": (4, ["--expert-model-parallel-size", "4", *A2A]),
    "ep2_tp2_sp_etp1_alltoall": (4, [*EP2, *TP2_SP, "--expert-tensor-parallel-size", "1", *A2A]),
    "ep2_pp2_virtual_alltoall": (4, [*EP2, *PP2_VIRTUAL, *A2A]),
    "ep2_dp2_zero1_alltoall": (4, [*EP2, *ZERO1, *A2A]),
    "ep2_compiled_alltoall": (2, [*EP2, "--compile", *A2A]),
    "ep2_flex": (
        2,
        [*EP2, "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"],
    ),
    "cp2_ep2": (4, [*CP2, *EP2]),
    "cp2_ep2_zero1_alltoall": (4, [*CP2, *EP2, *ZERO1, *A2A]),
    "cp2_tp2_sp_ep2_etp1": (4, [*CP2, *TP2_SP, *EP2, "--expert-tensor-parallel-size", "1"]),
    "pp2_tp2_sp": (4, [*TP2_SP, "--pipeline-model-parallel-size", "2"]),
    "tied_pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "packed_tp2": (2, ["--sft-sequence-packing", "--tensor-model-parallel-size", "2"]),
    "packed_dp2_zero1": (2, ["--sft-sequence-packing", *ZERO1]),
    "dp2_fsdp": (
        2,
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
    ),
    "tp2_sp_zero1": (2, [*TP2_SP, *ZERO1]),
    # hybrid sharding: the sharded state replicated over 2 instances
    "dp4_zero1_hybrid2": (4, [*ZERO1, *HYBRID2]),
    "dp4_fsdp_hybrid2": (4, [*FSDP, *HYBRID2]),
    "dp4_optim_grads_hybrid2": (
        4,
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", *HYBRID2],
    ),
    "cp2_dp2_zero1_hybrid2": (4, [*CP2, *ZERO1, *HYBRID2]),
    "pp2_dp2_fsdp_hybrid2": (4, ["--pipeline-model-parallel-size", "2", *FSDP, *HYBRID2]),
    # uneven pipeline stages (4 decoder layers): Megatron's flags and its layout strings
    "pp2_first1": (2, ["--pipeline-model-parallel-size", "2", *FIRST1]),
    "pp3_embedding_loss_split": (
        3,
        [
            "--pipeline-model-parallel-size",
            "3",
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
        ],
    ),
    "pp2_uneven_layout": (2, ["--pipeline-model-parallel-size", "2", *UNEVEN_LAYOUT]),
    "pp2_uneven_zero_bubble": (
        2,
        [*FIRST1, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero_bubble"],
    ),
    "pp2_zero_bubble_compiled": (
        2,
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero_bubble", "--compile"],
    ),
    "pp2_zero_bubble_dp2_fsdp": (
        4,
        ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero_bubble", *FSDP],
    ),
    # the V schedules: the loss on pipeline rank 0, the turn between stages 1 and 2 on rank 1
    "pp2_zero_bubble_v": (2, ZB_V),
    "pp2_zero_bubble_v_dp2_fsdp": (4, [*ZB_V, *FSDP]),
    "pp2_zero_bubble_v_uneven": (
        2,
        [*ZB_V[:2], "--pipeline-schedule", "zero_bubble_v", "--pipeline-model-parallel-layout"]
        + ["E|tt|t|tL"],
    ),
    "pp2_dualpipe_v_tp2_sp": (4, [*DUALPIPE_V, *TP2_SP]),
    "pp2_dualpipe_v_compiled": (2, [*DUALPIPE_V, "--compile"]),
    "pp2_dualpipe_v": (2, DUALPIPE_V),
    "ep2_pp2_zero_bubble_v": (4, [*EP2, *ZB_V]),
    "pp2_uneven_layout_tp2_sp_zero1": (
        4,
        ["--pipeline-model-parallel-size", "2", *UNEVEN_LAYOUT, *TP2_SP, *ZERO1],
    ),
    "pp2_uneven_layout_compiled": (
        2,
        ["--pipeline-model-parallel-size", "2", *UNEVEN_LAYOUT, "--compile"],
    ),
}


def rows(names: list[str], fast: tuple[str, ...] = ()) -> list:
    """pytest parameters (name, world size, flags) of the named rows; all but the fast ones run
    under -m slow."""
    return [
        pytest.param(name, *TABLE[name], id=name, marks=() if name in fast else pytest.mark.slow)
        for name in names
    ]


def assert_same(got, want, iterations=20):
    """Two runs' curves (per key) agree to 1e-5, relative, over every iteration."""
    for key in want:
        assert len(got[key]) == len(want[key]) == iterations, key
        for a, b in zip(got[key], want[key]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, got[key], want[key])


def assert_resumes_there_and_back(tmp_path, single, layout, other):
    """A run of 20 iterations saved at iteration 10 at layout (nproc, flags) resumes at other
    (nproc, flags) on single's curve to iteration 15, and its checkpoint there back at layout on the
    curve to the end (dropout on, as by default)."""
    from harness.runner import DROPOUT, run_recipe

    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    decay = ["--lr-decay-iters", "20"]
    steps = [
        ("first", layout, ["--save", ckpt, "--train-iters", "10", *decay], None),
        (
            "second",
            other,
            ["--load", ckpt, "--save", back, "--save-interval", "15", "--train-iters", "15"]
            + decay,
            slice(10, 15),
        ),
        ("third", layout, ["--load", back], slice(15, 20)),
    ]
    for name, (nproc, flags), extra, part in steps:
        records, stdout = run_recipe(tmp_path, name, nproc, [*DROPOUT, *flags, *extra])
        if part is None:
            continue
        assert "resharded from tp " in stdout
        got = [r["lm_loss"] for r in records if "lm_loss" in r]
        assert_same({"lm_loss": got}, {"lm_loss": single["lm_loss"][part]}, iterations=5)
