"""Megatron's flags for the dense model: its shape, positions, activations and norms."""

from __future__ import annotations

from fmeg.config.declare import flag, group, not_positive, outside, switch


@group("model")
class ModelFlags:
    """The transformer's shape, biases, dropouts, initialization and vocabulary padding."""

    num_layers: int = flag("--num-layers", type=int, default=4, help="transformer layers")
    hidden_size: int = flag("--hidden-size", type=int, default=128, help="the model's width")
    num_attention_heads: int = flag(
        "--num-attention-heads",
        type=int,
        default=4,
        help="attention heads (query heads with grouped-query attention)",
    )
    num_query_groups: int | None = flag(
        "--num-query-groups",
        type=int,
        help="key/value heads; as in Megatron, used only with --group-query-attention",
    )
    group_query_attention: bool = switch(
        "--group-query-attention",
        help="grouped-query attention with --num-query-groups key/value heads (default 1)",
    )
    ffn_hidden_size: int | None = flag(
        "--ffn-hidden-size",
        type=int,
        help="default 4 * --hidden-size; with --swiglu, Megatron's int(8 * hidden / 3 / 64) * 64",
    )
    kv_channels: int | None = flag(
        "--kv-channels",
        type=int,
        help="the dimension of each attention head (default --hidden-size / --num-attention-heads)",
    )
    seq_length: int = flag("--seq-length", type=int, default=128, help="tokens per sample")
    max_position_embeddings: int | None = flag(
        "--max-position-embeddings", type=int, help="default: --seq-length"
    )
    qk_layernorm: bool = switch(
        "--qk-layernorm",
        help="a norm (--normalization) on each head's queries and keys before RoPE (Qwen3)",
    )
    add_qkv_bias: bool = switch(
        "--add-qkv-bias", help="a bias on q, k and v even with --disable-bias-linear (Qwen2.5)"
    )
    untie_embeddings_and_output_weights: bool = switch(
        "--untie-embeddings-and-output-weights",
        help="an output layer of its own instead of the word embedding's transpose",
    )
    disable_bias_linear: bool = switch(
        "--disable-bias-linear", help="no biases on the linear layers"
    )
    hidden_dropout: float = flag(
        "--hidden-dropout",
        type=float,
        default=0.1,
        help="dropout after attention's and the MLP's output projections",
    )
    attention_dropout: float = flag(
        "--attention-dropout",
        type=float,
        default=0.1,
        help="dropout on the attention probabilities",
    )
    init_method_std: float = flag(
        "--init-method-std",
        type=float,
        default=0.02,
        help="the standard deviation of the weights' normal initialization",
    )
    make_vocab_size_divisible_by: int = flag(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="pad the vocabulary to a multiple of this times tp",
    )
    padded_vocab_size: int | None = flag(
        "--padded-vocab-size",
        type=int,
        help="rows of the embedding and output tables (default: the tokenizer's vocabulary padded "
        "to a multiple of --make-vocab-size-divisible-by * tp); padding rows change no number",
    )

    def problems(self) -> list[str]:
        """Sizes, dropouts and the initialization's scale."""
        sizes = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
        optional = ("ffn_hidden_size", "num_query_groups", "max_position_embeddings")
        out = not_positive(self, *sizes, *optional, "padded_vocab_size", "init_method_std")
        out += outside(self, "hidden_dropout", 0, 1) + outside(self, "attention_dropout", 0, 1)
        if self.make_vocab_size_divisible_by <= 0:
            out.append("--make-vocab-size-divisible-by must be positive")
        return out


@group("positions")
class PositionFlags:
    """Learned or rotary positions, and Llama 3.1's frequency scaling."""

    position_embedding_type: str = flag(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope"],
    )
    no_position_embedding: bool = switch(
        "--no-position-embedding",
        help="no learned position embedding: with --position-embedding-type rope (which has none) "
        "a no-op",
    )
    use_rotary_position_embeddings: bool = switch(
        "--use-rotary-position-embeddings",
        help="Megatron's older spelling of --position-embedding-type rope",
    )
    rotary_base: float = flag(
        "--rotary-base", type=float, default=10000.0, help="RoPE's base (theta)"
    )
    rotary_percent: float = flag(
        "--rotary-percent",
        type=float,
        default=1.0,
        help="the fraction of each head that RoPE rotates",
    )
    use_rope_scaling: bool = switch("--use-rope-scaling", help="Llama 3.1's RoPE frequency scaling")
    rope_scaling_factor: float = flag(
        "--rope-scaling-factor",
        type=float,
        default=8.0,
        help="with --use-rope-scaling (Llama 3.2: 32)",
    )
    rope_scaling_low_freq_factor: float = flag(
        "--rope-scaling-low-freq-factor",
        type=float,
        default=1.0,
        help="with --use-rope-scaling: HF's low_freq_factor (Megatron fixes it at 1)",
    )
    rope_scaling_high_freq_factor: float = flag(
        "--rope-scaling-high-freq-factor",
        type=float,
        default=4.0,
        help="with --use-rope-scaling: HF's high_freq_factor (Megatron fixes it at 4)",
    )
    rope_scaling_original_max_position_embeddings: int = flag(
        "--rope-scaling-original-max-position-embeddings",
        type=int,
        default=8192,
        help="with --use-rope-scaling: the context the model was trained at (Megatron fixes it at "
        "8192)",
    )

    def problems(self) -> list[str]:
        out = not_positive(self, "rotary_base")
        if self.no_position_embedding and self.position_embedding_type != "rope":
            out.append(
                "--no-position-embedding without --position-embedding-type rope would leave the "
                "model no positions; fmeg does not support that yet: add "
                "--position-embedding-type rope"
            )
        return out


@group("activations and norms")
class ActivationFlags:
    """The MLP's activation and the norms."""

    normalization: str = flag(
        "--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"]
    )
    swiglu: bool = switch(
        "--swiglu", help="the gated SiLU MLP (Llama's), its hidden width 2/3 of GELU's by default"
    )
    squared_relu: bool = switch("--squared-relu", help="relu(x)^2 as the MLP's activation")
    openai_gelu: bool = switch("--openai-gelu", help="GELU with the tanh approximation (GPT-2's)")
    no_bias_gelu_fusion: bool = switch(
        "--no-bias-gelu-fusion",
        help="exact (erf) GELU: as in Megatron, whose default fused bias-GELU is the tanh "
        "approximation (also exact with --disable-bias-linear, which turns that fusion off)",
    )
    norm_epsilon: float = flag(
        "--norm-epsilon", type=float, default=1e-5, help="the epsilon of LayerNorm or RMSNorm"
    )
    apply_layernorm_1p: bool = switch(
        "--apply-layernorm-1p",
        help="norm weights centred on zero: the norm scales by 1 + weight, and weights start at 0",
    )

    def problems(self) -> list[str]:
        return not_positive(self, "norm_epsilon")
