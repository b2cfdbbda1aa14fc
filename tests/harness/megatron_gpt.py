"""megatron-core's GPTModel (local spec, CPU, fp32) holding fmeg's parameters, run on a gloo rank of
its own: the reference of tests/models/test_mtp.py (with its MultiTokenPredictionBlock) and
tests/models/test_gpt_oss.py (sinks, sliding windows, the clamped quick-GEGLU, biases, YaRN)."""

import contextlib

import torch
import torch.nn.functional as F

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn.qkv": "self_attention.linear_qkv",
    "attn.proj": "self_attention.linear_proj",
    "mlp_norm": "pre_mlp_layernorm",
    "mlp.fc1": "mlp.linear_fc1",
    "mlp.fc2": "mlp.linear_fc2",
}
_MTP = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_norm.weight": "final_layernorm.weight",
}
_TOP = {
    "embedding.word.weight": "embedding.word_embeddings.weight",
    "output.weight": "output_layer.weight",
    "final_norm.weight": "decoder.final_layernorm.weight",
}


def _layer_name(rest: str) -> str:
    if rest == "attn.sinks":
        return "self_attention.core_attention.softmax_offset"
    module, leaf = rest.rsplit(".", 1)
    return f"{_LAYER[module]}.{leaf}"


def megatron_name(path: str) -> str:
    """fmeg's path (a dense model with RMSNorm and a gated MLP, untied) -> megatron-core's
    local-spec name."""
    if path in _TOP:
        return _TOP[path]
    parts = path.split(".")
    if parts[0] == "layers":
        return f"decoder.layers.{parts[1]}.{_layer_name('.'.join(parts[2:]))}"
    rest = ".".join(parts[2:])
    if rest.startswith("layer."):
        return f"mtp.layers.{parts[1]}.transformer_layer.{_layer_name(rest.removeprefix('layer.'))}"
    return f"mtp.layers.{parts[1]}.{_MTP[rest]}"


# megatron-core's get_sliding_window_causal_mask, on the CPU
def _window_mask(sq, skv, window_size):
    keep = (
        torch.ones(sq, skv, dtype=torch.bool)
        .triu(skv - sq - window_size[0])
        .tril(skv - sq + window_size[1])
    )
    return ~keep


def _gpt_oss_fields(c) -> dict:
    """megatron-core's TransformerConfig fields of fmeg's GPT-OSS options."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    fields = {
        "softmax_type": c.attention.softmax_type,
        "add_bias_linear": c.bias,
        "activation_func": F.silu,
    }
    if c.attention.window_size is not None:
        freq = c.attention.window_attn_skip_freq
        fields |= {
            "window_size": (c.attention.window_size, 0),
            "window_attn_skip_freq": list(freq) if isinstance(freq, tuple) else freq,
        }
    if c.activation == "quick_geglu":
        fields |= {
            "activation_func": quick_gelu,
            "glu_linear_offset": c.mlp.glu_linear_offset,
            "activation_func_clamp_value": c.mlp.clamp,
        }
    return fields


def _yarn(model, c) -> None:
    """fmeg's YaRN settings on megatron-core's config, as Megatron's --enable-gpt-oss puts them
    there."""
    for name, value in {
        "yarn_rotary_scaling_factor": c.rope.yarn.factor,
        "yarn_mscale": c.rope.yarn.mscale,
        "yarn_original_max_position_embeddings": c.rope.yarn.original_max_position_embeddings,
        "yarn_beta_fast": c.rope.yarn.beta_fast,
        "yarn_beta_slow": c.rope.yarn.beta_slow,
        "yarn_mscale_all_dim": c.rope.yarn.mscale_all_dim,
        "yarn_correction_range_round_to_int": c.rope.yarn.round_to_int,
    }.items():
        setattr(model, name, value)


def megatron_gpt(mesh, params, batch, config):
    """(lm loss, [each MTP depth's loss], {fmeg path: gradient}) of megatron-core's GPTModel holding
    params, trained as Megatron trains: the masked mean of its token losses, backward, with the MTP
    losses injected by its MTPLossAutoScaler (seed 1). One rank; parallel_state is initialised for
    it."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmeg import tree

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    # megatron-core moves its RoPE table to the current CUDA device
    torch.cuda.current_device = lambda: "cpu"
    try:
        model_parallel_cuda_manual_seed(0)
    # CPU only: without dropout the CUDA RNG tracker has nothing to fork
    except Exception:
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    logged: dict[int, float] = {}

    # its tracker all-reduces with AVG (not on gloo)
    def save_loss_to_tracker(loss, layer_number, num_layers, **_):
        logged[layer_number] = loss.item()

    multi_token_prediction.MTPLossLoggingHelper.save_loss_to_tracker = staticmethod(
        save_loss_to_tracker
    )
    fused_softmax.get_sliding_window_causal_mask = _window_mask
    c = config
    tc = TransformerConfig(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        num_query_groups=c.num_kv_heads,
        ffn_hidden_size=c.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.norm_eps,
        gated_linear_unit=True,
        init_method_std=c.init_std,
        **_gpt_oss_fields(c),
        mtp_num_layers=c.mtp_depth or None,
        mtp_loss_scaling_factor=c.mtp.loss_scaling_factor if c.mtp else 0.1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = (
        get_gpt_mtp_block_spec(tc, spec, use_transformer_engine=False) if c.mtp_depth else None
    )
    if c.rope.kind == "yarn":
        _yarn(tc, c)
    model = (
        GPTModel(
            tc,
            spec,
            vocab_size=c.vocab_size,
            max_sequence_length=c.max_seq_len,
            share_embeddings_and_output_weights=False,
            position_embedding_type=c.rope.kind,
            rotary_base=int(c.rope.theta),
            mtp_block_spec=mtp_spec,
        )
        .float()
        .train()
    )
    state = {}
    for path, leaf in tree.items(params):
        fc1 = {"fc1.weight": leaf.reshape(-1, leaf.shape[-1]), "fc1.bias": leaf.reshape(-1)}
        state[megatron_name(path)] = fc1.get(path[path.find("fc1.") :], leaf)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("_extra_state" in m for m in missing), (missing, unexpected)
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"].float()
    b, s = tokens.shape
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    losses = model(
        tokens, torch.arange(s)[None].expand(b, s), causal, labels=labels, loss_mask=mask
    )
    lm = (losses * mask).sum() / mask.sum()
    lm.backward()
    by_name = dict(model.named_parameters())
    grads = {
        path: by_name[megatron_name(path)].grad.reshape(leaf.shape)
        for path, leaf in tree.items(params)
    }
    return lm.item(), [logged[k] for k in range(c.mtp_depth)], grads
