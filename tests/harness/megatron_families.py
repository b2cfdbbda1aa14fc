"""fmeg's GPTConfig of each model tests/harness/megatron_core_run.py builds in megatron-core (its
FAMILIES), with Megatron's vocabulary of 127 padded to 128 rows."""

from fmeg.models import gpt

LLAMA = gpt.GPTConfig(
    vocab_size=127,
    padded_vocab_size=128,
    max_seq_len=32,
    num_layers=4,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=96,
    norm="rmsnorm",
    activation="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
    rope_theta=10000.0,
    norm_eps=1e-5,
)
CONFIGS = {
    "llama": LLAMA,
    # the Mixtral script's, in its args
    "qwen3_moe": LLAMA.replace(
        qk_norm=True,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=48,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_aux_loss_coeff=1e-2,
    ),
    "gpt2": LLAMA.replace(
        num_layers=2,
        num_kv_heads=4,
        ffn_hidden_size=256,
        norm="layernorm",
        activation="gelu",
        position="learned",
        bias=True,
        tie_embeddings=True,
    ),
}
CONFIGS["gpt2_moe"] = CONFIGS["gpt2"].replace(
    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_bias=True
)
