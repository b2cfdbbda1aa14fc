"""Text generation as pure functions over the training parameters: a KV cache that is a pytree, a
cached forward that runs on a tensor-parallel shard and on one pipeline stage, sampling from a key,
and a loop."""

from fmeg.inference.cached_forward import stage_forward
from fmeg.inference.generate import Generation, generate
from fmeg.inference.kv_cache import KVCache, new_cache
from fmeg.inference.sampling import SamplingParams, sample, token_logprobs

__all__ = [
    "Generation",
    "KVCache",
    "SamplingParams",
    "generate",
    "new_cache",
    "sample",
    "stage_forward",
    "token_logprobs",
]
