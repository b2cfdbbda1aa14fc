"""megatron-core's MLASelfAttention on CPU holding fmeg's MLA parameters (tests/models/test_mla.py's
reference), run on a gloo rank of its own."""

import torch


def megatron_mla(mesh, attn_params, x_BSH, dout_BSH, config):
    """megatron-core's MLASelfAttention (local spec, CPU, fp32) holding fmeg's layer parameters
    attn_params: (its output [b, s, h] for x, the gradients of its parameters under fmeg's names and
    of x, for the output gradient dout). One rank; parallel_state is initialised for it."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    # megatron-core's RoPE moves its table to the current CUDA device
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    try:
        model_parallel_cuda_manual_seed(0)
    # CPU only: without dropout, the CUDA RNG tracker has nothing to fork
    except Exception:
        import contextlib

        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    c = config
    yarn = c.rope.yarn
    tc = MLATransformerConfig(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        ffn_hidden_size=c.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=c.norm_eps,
        add_bias_linear=c.bias,
        qk_layernorm=c.attention.qk_norm,
        q_lora_rank=c.attention.mla.q_lora_rank,
        kv_lora_rank=c.attention.mla.kv_lora_rank,
        qk_head_dim=c.attention.mla.qk_head_dim,
        qk_pos_emb_head_dim=c.attention.mla.qk_pos_emb_head_dim,
        v_head_dim=c.attention.mla.v_head_dim,
        rope_type=c.rope.kind,
        rotary_base=c.rope.theta,
        rotary_scaling_factor=yarn.factor,
        mscale=yarn.mscale,
        mscale_all_dim=yarn.mscale_all_dim,
        original_max_position_embeddings=yarn.original_max_position_embeddings,
        beta_fast=yarn.beta_fast,
        beta_slow=yarn.beta_slow,
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
    from megatron.core.transformer import multi_latent_attention

    # Transformer Engine absent: megatron-core's stand-in
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=c.attention.qk_norm, normalization="RMSNorm"
    )
    attention = spec.submodules.self_attention
    # its local core takes no separate key size
    attention.submodules.core_attention = SoftmaxAttentionCore
    module = MLASelfAttention(tc, attention.submodules, layer_number=1, **attention.params).float()
    names = {
        "q": "linear_q_proj",
        "q_down": "linear_q_down_proj",
        "q_up": "linear_q_up_proj",
        "kv_down": "linear_kv_down_proj",
        "kv_up": "linear_kv_up_proj",
        "proj": "linear_proj",
        "q_latent_norm": "q_layernorm",
        "kv_latent_norm": "kv_layernorm",
    }
    state = {f"{names[k]}.{leaf}": v for k, sub in attn_params.items() for leaf, v in sub.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    assert not unexpected and all("_extra_state" in m for m in missing), (missing, unexpected)
    x = x_BSH.transpose(0, 1).detach().clone().requires_grad_()
    s = x.shape[0]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    out, bias = module(x, mask)
    out = out if bias is None else out + bias
    out.backward(dout_BSH.transpose(0, 1))
    inverse = {v: k for k, v in names.items()}
    grads = {}
    for name, param in module.named_parameters():
        owner, leaf = name.rsplit(".", 1)
        grads.setdefault(inverse[owner], {})[leaf] = param.grad
    return out.detach().transpose(0, 1), grads, x.grad.transpose(0, 1)


class SoftmaxAttentionCore(torch.nn.Module):
    """The attention core megatron-core's MLA builds (its softmax_scale, key and value sizes),
    written out as causal softmax(q k^T * softmax_scale) v on [s, b, n, d] tensors: Transformer
    Engine's core, which megatron-core uses for MLA, is not on CPU, and its local core takes one
    head size."""

    def __init__(
        self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_
    ):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):
        scores = torch.einsum("sbnd,tbnd->bnst", query, key) * self.softmax_scale
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), value)
        return out.reshape(*out.shape[:2], -1)
