"""What the runner reports: model FLOPs, a memory estimate, and the loss-curve picture (pure
helpers)."""

from __future__ import annotations

from pathlib import Path

from fmeg.fp8.plan import fp8_start_line
from fmeg.models import gpt_pipeline as gp
from fmeg.models.gpt import GPTConfig
from fmeg.parallel.layout import Layout
from fmeg.training.stage_functions import stage_compilation


def model_flops(config: GPTConfig, global_batch: int, seq_len: int) -> float:
    """Megatron's num_floating_point_operations (forward and backward, every matmul three times): 12
    B s L h^2 ((1 + G/N + s/h) (N d / h) + (F / h) (3/2 with SwiGLU) + Vp / (2 L h)), for N query
    heads of size d in G groups, MLP width F and the padded vocabulary Vp. GPT-2 shapes reduce it to
    72 B s L h^2 (1 + s/6h + V/12Lh). With experts, F is Megatron's average over the layers: F on
    dense layers, topk * the expert width + the shared expert's on MoE layers (the router's matmul
    is not counted). Multi-latent attention counts as any attention does: 6 x its projections'
    weights + 6 s N (dq + dr + dv) for the scores and the values, per token and layer (Megatron's
    MLA count, less its norms' per-token terms). Multi-token prediction adds, as Megatron counts it,
    6 (3h + 2h^2) per token and depth for its norms and eh_proj and one more output layer per depth:
    Megatron leaves the depths' transformer layers out, and so does this count."""
    return sum(layer_flops(config, global_batch, seq_len)) + head_flops(
        config, global_batch, seq_len
    )


def _attention_terms(config: GPTConfig, seq_len: int) -> float:
    """A layer's attention matmuls in units of 2 h^2 per token (model_flops' attention term)."""
    c, s, h = config, seq_len, config.hidden_size
    mla = c.attention.mla
    if mla is None:
        return (1 + c.num_kv_heads / c.num_heads + s / h) * (c.num_heads * c.head_dim / h)
    n, dq, dr, dv = c.num_heads, mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim
    q = h * n * (dq + dr) if mla.q_lora_rank is None else mla.q_lora_rank * (h + n * (dq + dr))
    weights = q + h * (mla.kv_lora_rank + dr) + mla.kv_lora_rank * n * (dq + dv) + n * dv * h
    return (weights + s * n * (dq + dr + dv)) / (2 * h * h)


def layer_flops(config: GPTConfig, global_batch: int, seq_len: int) -> list[float]:
    """Each decoder layer's share of model_flops: 12 B s h^2 (attention + its MLP's F / h, x 3/2
    with SwiGLU; an MoE layer's F is topk x the expert width + the shared expert's)."""
    from fmeg.models.moe import expert_ffn, moe_layers

    c, h = config, config.hidden_size
    gated = 1.5 if c.activation == "swiglu" else 1.0
    experts = (
        expert_ffn(c) * c.experts.router.topk + (c.experts.shared_expert_intermediate_size or 0)
        if c.experts
        else 0
    )
    attention = _attention_terms(c, seq_len)
    scale = 12.0 * global_batch * seq_len * h * h
    return [
        scale * (attention + (experts if moe else c.ffn_hidden_size) / h * gated)
        for moe in moe_layers(c)[: c.num_layers]
    ]


def head_flops(config: GPTConfig, global_batch: int, seq_len: int) -> float:
    """The last stage's share of model_flops beyond its decoder layers: the output layer once per
    prediction depth and each multi-token prediction depth's norms and eh_proj."""
    c, h = config, config.hidden_size
    depths = c.mtp_depth
    return (
        12.0
        * global_batch
        * seq_len
        * (c.padded_vocab_size * h / 2 * (depths + 1) + depths * (3 * h + 2 * h * h) / 2)
    )


def stage_costs(
    config: GPTConfig,
    stage_layers: list[range],
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    cp: int = 1,
    activation_bytes: int = 4,
) -> list[tuple[int, float, float]]:
    """For each pipeline stage (its decoder layers' indices): (layers, model FLOPs of one
    microbatch's forward and backward on one of its tp x cp ranks, activation bytes one microbatch
    leaves there, as memory_estimate counts them). The last stage adds the head's FLOPs and the
    multi-token prediction depths' activations."""
    per_layer = layer_flops(config, micro_batch, seq_len)
    head = head_flops(config, micro_batch, seq_len)
    layer, depths = microbatch_activations(config, micro_batch, seq_len, tp, cp, activation_bytes)
    last = len(stage_layers) - 1
    return [
        (
            len(layers),
            (sum(per_layer[i] for i in layers) + (head if s == last else 0.0)) / (tp * cp),
            layer * len(layers) + (depths if s == last else 0.0),
        )
        for s, layers in enumerate(stage_layers)
    ]


def stage_ranges(config: GPTConfig, layout: Layout) -> list[range]:
    """Each pipeline stage's decoder layers (their indices in the model)."""
    return [gp.stage_layers(config, s, layout.stages) for s in range(layout.num_stages)]


def last_rank_layers(config: GPTConfig, layout: Layout) -> float:
    """The decoder layers the last pipeline rank holds, per virtual stage (memory_estimate's)."""
    ranges = stage_ranges(config, layout)
    return sum(len(ranges[s]) for s in layout.stages_on(layout.pp - 1)) / layout.chunks


def stages_line(config: GPTConfig, layout: Layout, seq_len: int, activation_bytes: int) -> str:
    """The start line's pipeline sentence: each stage's layers, GFLOP and activation MB per
    microbatch (stage_costs)."""
    costs = stage_costs(
        config,
        stage_ranges(config, layout),
        layout.micro_batch_size,
        seq_len,
        layout.tp,
        layout.cp,
        activation_bytes,
    )
    return (
        "pipeline stages (per microbatch on one rank of each): layers "
        + "|".join(str(n) for n, _, _ in costs)
        + "; GFLOP "
        + "|".join(f"{f / 1e9:.3g}" for _, f, _ in costs)
        + "; activations (MB) "
        + "|".join(f"{b / 2**20:.3g}" for _, _, b in costs)
    )


def activation_units(config: GPTConfig) -> float:
    """Activation bytes per token per layer in 16-bit, in units of h, averaged over the layers
    (before the 5 a s / h of the attention scores): Korthikanti et al. 2022's 34 for GPT-2's MLP of
    4h, with the MLP's 19 taken apart as 3 (its input, output dropout mask) + 4 F / h (the inputs of
    its activation and of fc2; x 1.5 with SwiGLU). An MoE layer keeps each of a token's topk copies
    (their rows, 2) through an expert of width F_e, and the shared expert as a dense MLP; the
    router's [E] scores are left out. The attention's 15 are its two norms' inputs (4), its input
    (2), q and k (4), v (2), the projection's input (2) and a dropout mask (1); multi-latent
    attention keeps q and k of N (dq + dr) dimensions, v and the projection's input of N dv, and
    each latent it makes (kv, and q's with q-lora) twice: as its norm's input and as its
    up-projection's."""
    from fmeg.models.moe import expert_ffn, moe_layers

    c, h = config, config.hidden_size
    attention = 15.0
    if c.attention.mla is not None:
        n, latents = c.num_heads, c.attention.mla.kv_lora_rank + (c.attention.mla.q_lora_rank or 0)
        attention = (
            7
            + (
                4 * latents
                + 4 * n * (c.attention.mla.qk_head_dim + c.attention.mla.qk_pos_emb_head_dim)
                + 4 * n * c.attention.mla.v_head_dim
            )
            / h
        )
    gated = 1.5 if c.activation == "swiglu" else 1.0
    dense = 3 + 4 * c.ffn_hidden_size / h * gated
    experts = (
        3
        + c.experts.router.topk * (2 + 4 * expert_ffn(c) / h * gated)
        + 4 * (c.experts.shared_expert_intermediate_size or 0) / h * gated
        if c.experts
        else dense
    )
    moe = sum(moe_layers(c))
    return attention + (dense * (c.num_layers - moe) + experts * moe) / c.num_layers


def holds_attention_scores(config: GPTConfig) -> bool:
    """Whether training keeps each layer's [b, heads, s, s] attention probabilities: with attention
    dropout (dropped by a counter-based mask on explicit probabilities) or with sinks or a sliding
    window (ops.sink_attention); scaled_dot_product_attention's fused kernels keep none."""
    return (
        config.attention.dropout > 0
        or config.attention.softmax_type != "vanilla"
        or config.attention.window_size is not None
    )


def microbatch_activations(
    config: GPTConfig, micro_batch: int, seq_len: int, tp: int, cp: int, activation_bytes: int
) -> tuple[float, float]:
    """(one decoder layer's, all the multi-token prediction depths') activation bytes for one
    microbatch on one rank, as memory_estimate counts them."""
    s, b, h, a = seq_len, micro_batch, config.hidden_size, config.num_heads
    scores = 5 * a * s / h if holds_attention_scores(config) else 0.0
    layer = s * b * h * (activation_units(config) + scores) / (tp * cp) * (activation_bytes / 2)
    depth = layer + 8 * s * b * h / (tp * cp) * (activation_bytes / 2)
    return layer, depth * config.mtp_depth


def memory_estimate(
    local_params: int,
    state_bytes: int,
    config: GPTConfig,
    micro_batch: int,
    seq_len: int,
    tp: int,
    pp: int,
    in_flight: int,
    activation_bytes: int = 4,
    cp: int = 1,
    layers: float | None = None,
) -> dict[str, float]:
    """Bytes per rank: weights and fp32 gradients, optimizer state, and activations of the
    microbatches a rank holds at once (Korthikanti et al. 2022: s b h (units + 5 a s / h) per layer
    in 16-bit, / tp; units as activation_units says, 34 for GPT-2 shapes). The 5 a s / h term is the
    attention scores, counted only where fmeg holds them (holds_attention_scores): fused attention
    keeps none. Context parallelism holds s / cp of the tokens, their scores against the whole
    sequence. The last stage also holds each multi-token prediction depth: one more layer and the 8
    h of its two norms' inputs and its eh_proj's [2h] input. layers: the decoder layers the rank
    holds (None: num_layers / pp)."""
    layer, depths = microbatch_activations(config, micro_batch, seq_len, tp, cp, activation_bytes)
    held = config.num_layers / pp if layers is None else layers
    activations = (layer * held + depths) * in_flight
    # compute copy + fp32 gradient buffer
    weights = local_params * (activation_bytes + 4)
    return {
        "weights_and_grads": weights,
        "optimizer": float(state_bytes),
        "activations": activations,
        "total": weights + state_bytes + activations,
    }


def draw_loss_curve(records: list[dict], path: str | Path) -> Path | None:
    """loss.png from metrics records (training and validation); None without matplotlib."""
    try:
        # a Figure of its own, without pyplot: no global state, no GUI backend, and a second less
        # of imports at the end of every run
        from matplotlib.figure import Figure
    except ImportError:
        return None
    train = [(r["iteration"], r["lm_loss"]) for r in records if "lm_loss" in r]
    valid = [
        (r["iteration"], r["validation_lm_loss"]) for r in records if "validation_lm_loss" in r
    ]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(*zip(*train), label="lm loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)
    return path


def fp8_line(cfg, session) -> str:
    """The start line's FP8 sentence for the run (cfg: its RunConfig; session: its Session): the
    plan, where the GEMMs run, and whether delayed scaling's stages run eagerly."""
    plan = cfg.precision.fp8
    backend, _ = stage_compilation(
        session.compile, cfg.layout, cfg.runtime.overlap_grad_reduce, plan
    )
    eager = session.compile is not None and backend is None
    return fp8_start_line(plan, session.device, cfg.layout.sharding, eager)
