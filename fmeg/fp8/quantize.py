"""Quantization to FP8 and back, as pure functions: a high-precision tensor -> (data, scale) with
data = saturate(x * scale) in an FP8 dtype, so x ~ data / scale.

    q = quantize_tensorwise(x, E4M3, amax)      # scale [] : fp8_max / amax (TorchAO's definition)
    q = quantize_blocks(x, E4M3, 128)           # scale [rows, ceil(K / 128)], powers of two
    q = quantize_tiles(w, E4M3, 128)            # scale [ceil(N / 128), ceil(K / 128)]
    x_hat = dequantize(q)                       # fp32, x's shape

Blocks run along the last dimension (the GEMM's reduction dimension); a last block shorter than the
block size is its own block. Block scales are powers of two (rounded down): dequantizing is exact
in any dtype with fp32's exponent range, and the mxfp8 scales are exactly e8m0 values. A scale is
computed in fp64 and rounded to fp32 (TorchAO's amax_to_scale); an amax of 0 is clamped to 1e-12,
so a zero tensor stays zero. An inf or NaN in x gives NaN data: the step's non-finite check
stops on it, as Megatron's does, rather than training on a saturated number.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-12


@dataclass(frozen=True)
class Quantized:
    """FP8 data and the scale that multiplied it: tensorwise [], per row [rows, 1], per block
    [rows, blocks] (block: the block's length along the last dim) or per tile [row tiles, col
    tiles] (tile: the tile's side)."""

    data: torch.Tensor
    scale: torch.Tensor
    block: int | None = None
    tile: int | None = None


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False):
    """fp8_max / amax in fp64, rounded to fp32 (optionally down to a power of two)."""
    scale = (fp8_max(dtype) / amax.double().clamp(min=EPS)).float()
    if power_of_two:
        # floor(log2(scale)) through frexp: exact, and a NaN stays NaN
        _, exponent = torch.frexp(scale)
        down = torch.ldexp(torch.ones_like(scale), exponent - 1)
        # 0 (an inf amax) and NaN stay as they are; e8m0's largest scale is 2^127
        scale = torch.where(scale.isfinite() & (scale > 0), down, scale).clamp(max=2.0**127)
    return scale


def _saturate(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return (x.float() * scale).clamp(-m, m).to(dtype)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Quantized:
    """x with a given tensor-wise scale (delayed scaling's, or a saved forward scale)."""
    return Quantized(_saturate(x, scale, dtype), scale)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| in fp32 (NaN if x holds one)."""
    return x.detach().abs().amax().float()


def quantize_tensorwise(
    x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor | None = None
) -> Quantized:
    """One scale for the whole tensor, from amax (default: x's own; callers pass the amax reduced
    over the ranks that split the tensor, so every rank uses the one-device scale)."""
    scale = amax_to_scale(tensor_amax(x) if amax is None else amax, dtype)
    return Quantized(_saturate(x, scale, dtype), scale)


def _blocked(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """x [rows, K] -> [rows, ceil(K / block), block], zero-padded."""
    k = x.shape[-1]
    pad = -k % block
    return torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, block)), k


def quantize_blocks(x: torch.Tensor, dtype: torch.dtype, block: int) -> Quantized:
    """x [rows, K]: one power-of-two scale per row and `block` consecutive elements of the last
    dimension (block = K: TorchAO's rowwise)."""
    blocks, k = _blocked(x.float(), block)
    scale = amax_to_scale(blocks.abs().amax(dim=-1), dtype, power_of_two=True)
    data = _saturate(blocks, scale[..., None], dtype).flatten(-2)[..., :k]
    return Quantized(data, scale, block=block)


def quantize_tiles(w: torch.Tensor, dtype: torch.dtype, tile: int) -> Quantized:
    """w [N, K]: one power-of-two scale per tile x tile square (DeepSeek-V3's weights)."""
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % tile, 0, -n % tile))
    tiles = padded.unflatten(0, (-1, tile)).unflatten(-1, (-1, tile))  # [n/t, t, k/t, t]
    scale = amax_to_scale(tiles.abs().amax(dim=(1, 3)), dtype, power_of_two=True)
    data = _saturate(tiles, scale[:, None, :, None], dtype).flatten(2).flatten(0, 1)
    return Quantized(data[:n, :k], scale, tile=tile)


def dequantize(q: Quantized) -> torch.Tensor:
    """data / scale in fp32, in data's shape."""
    data = q.data.float()
    if q.block is not None:
        k = data.shape[-1]
        blocks, _ = _blocked(data, q.block)
        return (blocks / q.scale[..., None]).flatten(-2)[..., :k]
    if q.tile is not None:
        rows = q.scale.repeat_interleave(q.tile, 0)[: data.shape[0]]
        return data / rows.repeat_interleave(q.tile, 1)[:, : data.shape[1]]
    return data / q.scale
