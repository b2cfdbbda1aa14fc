"""megatron-core's GPTModel with a MultiTokenPredictionBlock on CPU holding fmeg's parameters (tests/test_mtp.py's
reference), run on a gloo rank of its own."""

import contextlib

import torch
import torch.nn.functional as F

_LAYER = {"attn_norm.weight": "input_layernorm.weight", "attn.qkv.weight": "self_attention.linear_qkv.weight",
          "attn.proj.weight": "self_attention.linear_proj.weight", "mlp_norm.weight": "pre_mlp_layernorm.weight",
          "mlp.fc1.weight": "mlp.linear_fc1.weight", "mlp.fc2.weight": "mlp.linear_fc2.weight"}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "final_norm.weight": "final_layernorm.weight"}
_TOP = {"embedding.word.weight": "embedding.word_embeddings.weight", "output.weight": "output_layer.weight",
        "final_norm.weight": "decoder.final_layernorm.weight"}


def megatron_name(path: str) -> str:
    """fmeg's path (a llama-shaped model: RMSNorm, SwiGLU, no biases, untied) -> megatron-core's local-spec name."""
    if path in _TOP:
        return _TOP[path]
    parts = path.split(".")
    if parts[0] == "layers":
        return f"decoder.layers.{parts[1]}.{_LAYER['.'.join(parts[2:])]}"
    rest = ".".join(parts[2:])
    if rest.startswith("layer."):
        return f"mtp.layers.{parts[1]}.transformer_layer.{_LAYER[rest.removeprefix('layer.')]}"
    return f"mtp.layers.{parts[1]}.{_MTP[rest]}"


def megatron_mtp(mesh, params, batch, config):
    """(lm loss, [each depth's loss], {fmeg path: gradient}) of megatron-core's GPTModel holding params, trained as
    Megatron trains: the masked mean of its token losses, backward, with the MTP losses injected by its
    MTPLossAutoScaler (seed 1). One rank; parallel_state is initialised for it."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fmeg import tree

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    torch.cuda.current_device = lambda: "cpu"  # megatron-core moves its RoPE table to the current CUDA device
    try:
        model_parallel_cuda_manual_seed(0)
    except Exception:  # noqa: BLE001 - CPU only: without dropout the CUDA RNG tracker has nothing to fork
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    logged: dict[int, float] = {}

    def save_loss_to_tracker(loss, layer_number, num_layers, **_):  # its tracker all-reduces with AVG (not on gloo)
        logged[layer_number] = loss.item()

    multi_token_prediction.MTPLossLoggingHelper.save_loss_to_tracker = staticmethod(save_loss_to_tracker)
    c = config
    tc = TransformerConfig(
        num_layers=c.num_layers, hidden_size=c.hidden_size, num_attention_heads=c.num_heads,
        num_query_groups=c.num_kv_heads, ffn_hidden_size=c.ffn_hidden_size, normalization="RMSNorm",
        layernorm_epsilon=c.norm_eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        mtp_num_layers=c.mtp_num_layers, mtp_loss_scaling_factor=c.mtp_loss_scaling_factor,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(tc, spec, use_transformer_engine=False)
    model = GPTModel(tc, spec, vocab_size=c.vocab_size, max_sequence_length=c.max_seq_len,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(c.rope_theta), mtp_block_spec=mtp_spec).float().train()
    state = {}
    for path, leaf in tree.items(params):
        state[megatron_name(path)] = leaf.reshape(-1, leaf.shape[-1]) if path.endswith("fc1.weight") else leaf
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("_extra_state" in m for m in missing), (missing, unexpected)
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"].float()
    b, s = tokens.shape
    causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    losses = model(tokens, torch.arange(s)[None].expand(b, s), causal, labels=labels, loss_mask=mask)
    lm = (losses * mask).sum() / mask.sum()
    lm.backward()
    by_name = dict(model.named_parameters())
    grads = {path: by_name[megatron_name(path)].grad.reshape(leaf.shape) for path, leaf in tree.items(params)}
    return lm.item(), [logged[k] for k in range(c.mtp_num_layers)], grads
