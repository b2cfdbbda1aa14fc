"""ZeRO-1: optimizer state per rank follows Megatron's figures (8 / dp bytes per parameter in fp32,
12 / dp with bf16 and its fp32 main weights)."""

import pytest
import torch

from harness import spmd_programs as P
from fmeg.models import gpt
from fmeg.parallel.spmd import run_threads

CONFIG = gpt.GPTConfig.gpt2(
    vocab_size=96, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4
)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("dtype, per_param", [(torch.float32, 8), (torch.bfloat16, 12)])
def test_optimizer_state_bytes_per_rank_follow_megatron(dp, dtype, per_param):
    """fp32: Adam's two moments, 8 / dp bytes per parameter; bf16 adds fp32 main weights: 12 /
    dp."""
    results = run_threads(dp, P.zero_state_bytes, CONFIG, dtype)
    # state_bytes: no step counter
    for state_bytes, num_params, padded, model_dtype, persistent in results:
        assert model_dtype == dtype
        assert padded - num_params < dp  # padding only to a multiple of dp
        assert state_bytes == per_param * padded // dp
        assert abs(state_bytes - per_param * num_params / dp) <= per_param
        # everything kept between steps: compute weights, the fp32 gradient buffer and the above
        assert persistent * num_params == (dtype.itemsize + 4) * padded + state_bytes
