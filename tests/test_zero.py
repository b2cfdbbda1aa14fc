"""ZeRO-1: optimizer state per rank is 8 / dp bytes per parameter in fp32 (Adam's two moments)."""

import pytest

import spmd_programs as P
from fmeg.models import gpt
from fmeg.parallel.spmd import run_threads

CONFIG = gpt.GPTConfig.gpt2(vocab_size=96, max_seq_len=16, num_layers=2, hidden_size=32, num_heads=4)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_optimizer_state_bytes_per_rank_are_8_over_dp_per_parameter(dp):
    results = run_threads(dp, P.zero_state_bytes, CONFIG)
    for state_bytes, num_params, padded in results:
        assert padded - num_params < dp  # padding only to a multiple of dp
        assert state_bytes == 8 * padded // dp
        assert abs(state_bytes - 8 * num_params / dp) <= 8
