"""Choosing the next token as a pure function of logits and a key.

    ids = sample(logits_BV, SamplingParams(temperature=0.8, top_k=40, top_p=0.95), key)

Greedy when temperature is 0 (or top_k is 1); otherwise the logits are divided by the temperature,
cut to the top_k largest (0: no cut), then to the smallest set whose probability reaches top_p (0 or
1: no cut), as Megatron and transformers order them, and a token is drawn by the Gumbel-max trick
with counter-based noise: uniform(key of the row, id). The draw depends only on (the row's key, its
logits), never on a global generator or on the other rows, so every tensor-parallel rank draws the
same token from the same gathered logits, a run is reproducible across layouts, and a row batched
with others draws what it draws alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fmeg.ops.random import uniform


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def filtered_logits(logits_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits / temperature with -inf outside the top-k and top-p sets."""
    x = logits_BV.float() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        # probability mass ahead of each token
        before = sorted_x.softmax(-1).cumsum(-1) - sorted_x.softmax(-1)
        # the first token is always kept
        drop = before >= params.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return x


def sample(
    logits_BV: torch.Tensor, params: SamplingParams, key: int | torch.Tensor
) -> torch.Tensor:
    """Token ids [b] for logits [b, vocab]; key: one key for every row, or a key per row [b]."""
    if params.greedy:
        return logits_BV.argmax(-1)
    x = filtered_logits(logits_BV, params)
    key = torch.as_tensor(key, dtype=torch.int64, device=x.device)
    u = uniform(key.reshape(-1, 1), torch.arange(x.shape[-1], device=x.device)).clamp(min=2.0**-25)
    return (x - torch.log(-torch.log(u))).argmax(-1)


def token_logprobs(logits_BV: torch.Tensor, ids_B: torch.Tensor) -> torch.Tensor:
    """log p(id) under the model's own distribution (the raw logits: no temperature, no cut), fp32
    [b]."""
    return torch.log_softmax(logits_BV.float(), -1).gather(-1, ids_B[:, None])[:, 0]
