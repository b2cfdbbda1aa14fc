"""Counter-based random numbers and dropout.

A random value is a hash of (key, element index), not a draw from a stateful generator. That makes
dropout a pure function: the same key and index give the same mask under grad, vmap and compile, and
a sharded caller that passes each element's global index gets the mask the unsharded model gets.
Integer arithmetic stays below 2**63 so nothing relies on signed overflow.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply rounds), elementwise on int64 holding 32-bit
    values."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 16)
    return x


def fold_in(key: int | torch.Tensor, *data: int) -> torch.Tensor:
    """A new key from a key and integers (layer, site, microbatch...), as jax.random.fold_in."""
    key = torch.as_tensor(key, dtype=torch.int64)
    # key * 0 + d, not as_tensor(d): under torch.compile a symbolic d stays symbolic
    for d in data:
        key = _hash32(key ^ _hash32(key * 0 + d + 0x9E3779B9))
    return key


def uniform(key: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 values in [0, 1) with 24 random bits, one per element of the int64 tensor `index`."""
    key = torch.as_tensor(key, dtype=torch.int64, device=index.device)
    k_lo, k_hi = _hash32(key), _hash32((key >> 32) + 0x85EBCA6B)
    h = _hash32((index & _MASK32) ^ k_lo)
    h = _hash32(h ^ (index >> 32) ^ k_hi)
    h = _hash32(h + k_lo)
    return (h >> 8).float() * (1.0 / (1 << 24))


def normal(key: int | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 standard normal values, one per element of `index` (Box-Muller on two keyed
    uniforms)."""
    # in (0, 1]: its log is finite
    u1 = 1.0 - uniform(fold_in(key, 1), index)
    u2 = uniform(fold_in(key, 2), index)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * torch.pi * u2)


def dropout(
    x: torch.Tensor, p: float, key: int | torch.Tensor, *, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Zero each element with probability p and scale the rest by 1 / (1 - p).

    `index` gives each element's counter (default: its flat position in x); pass global positions to
    make the mask independent of how x is sharded.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0:
        return x
    if index is None:
        index = torch.arange(x.numel(), device=x.device).view(x.shape)
    keep = uniform(key, index) >= p
    return x * keep.to(x.dtype) / (1.0 - p)
