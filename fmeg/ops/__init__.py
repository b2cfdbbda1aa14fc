"""Single-device math: pure functions with no knowledge of ranks or process groups."""

from fmeg.ops.activations import gelu, gelu_tanh, mlp_activation, swiglu
from fmeg.ops.attention import causal_attention
from fmeg.ops.document_attention import document_attention
from fmeg.ops.cross_entropy import IGNORE_INDEX, cross_entropy, masked_mean, token_cross_entropy
from fmeg.ops.embedding import embedding
from fmeg.ops.linear import linear
from fmeg.ops.linear_cross_entropy import linear_cross_entropy
from fmeg.ops.norms import layer_norm, rms_norm
from fmeg.ops.random import dropout, fold_in, normal, uniform
from fmeg.ops.sink_attention import sink_attention, visible
from fmeg.ops.recompute import recomputed, recomputed_with
from fmeg.ops.rope import apply_rope, rope_cos_sin

__all__ = [
    "IGNORE_INDEX",
    "apply_rope",
    "causal_attention",
    "cross_entropy",
    "document_attention",
    "dropout",
    "embedding",
    "fold_in",
    "gelu",
    "gelu_tanh",
    "layer_norm",
    "mlp_activation",
    "linear",
    "linear_cross_entropy",
    "masked_mean",
    "recomputed",
    "recomputed_with",
    "rms_norm",
    "rope_cos_sin",
    "sink_attention",
    "swiglu",
    "token_cross_entropy",
    "uniform",
    "normal",
    "visible",
]
