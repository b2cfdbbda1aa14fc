"""--fp8-param-gather: the distributed optimizer's weight all-gather moves FP8 bytes. After each
step every data-parallel rank quantizes its owned chunk of each FP8 linear's weight with the scale
the next forward will use, all-gathers one byte per such element (and the compute dtype's bytes
for every other element), and writes the dequantized values into its compute weights.

    gather = Fp8ParamGather(pieces, units, chunk_starts, dp, dp_rank, dtype, recipe, groups)
    gather.record(state.master)                     # delayed scaling: the weights' amaxes, per step
    gather.refresh(state.master, state.weights, dp_group)

The forward then quantizes the dequantized weight to the FP8 numbers the gather sent: delayed
scaling's scale is the state's (the same number on both sides), and a tensor-wise scale taken
again from the dequantized weight is the gathered one (its largest element maps to the format's
largest value both times). Delayed scaling records each weight's amax from the owned chunks here
(the step's reduction makes it the whole weight's), not from the dequantized weight in the forward,
whose amax would be the old scale's image of the largest FP8 value.

Sharding contract: pieces are the flat ranges quantized with one scale (a dense FP8 linear's
weight, one expert's matrix); under tensor-wise scaling each piece's amax is the max over the owned
chunks of every rank in groups (the data-parallel ranks that own its other chunks and the
tensor-parallel ranks holding its other shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmeg.fp8.quantize import amax_to_scale, fp8_max
from fmeg.fp8.recipe import E4M3, Fp8Recipe


@dataclass(frozen=True)
class Fp8Piece:
    """Flat elements [start, start + numel) quantized with one scale; row: delayed scaling's state
    row of the weight's linear (None under other recipes)."""

    start: int
    numel: int
    row: int | None = None


@dataclass(frozen=True)
class _Unit:
    """One unit's byte layout: rank r sends its chunk's FP8 elements (one byte each), then, from a
    byte offset aligned to the compute dtype, its other elements; each rank sends `length`."""

    start: int
    length: int
    # gathered byte of each FP8 element, its unit position and its piece
    byte8: torch.Tensor
    at8: torch.Tensor
    piece8: torch.Tensor
    # gathered element (in the compute dtype's units) of each other element, its unit position
    other: torch.Tensor
    at_other: torch.Tensor
    # this rank's chunk: which of its elements are FP8 (their pieces), which not
    mine8: torch.Tensor
    mine_piece8: torch.Tensor
    mine_other: torch.Tensor


def _unit(a: int, b: int, dp: int, rank: int, piece_of: torch.Tensor, size: int) -> _Unit:
    """piece_of: each element of [a, b)'s piece, -1 for elements of no FP8 piece."""
    chunk = (b - a) // dp
    is8 = piece_of >= 0
    per_rank = [is8[r * chunk : (r + 1) * chunk] for r in range(dp)]
    counts = [int(m.sum()) for m in per_rank]
    offsets = [-(-n // size) * size for n in counts]
    # the same offsets as _aligned gives the sender
    length = max(o + (chunk - n) * size for o, n in zip(offsets, counts))
    length = -(-length // size) * size
    byte8, at8, other, at_other = [], [], [], []
    for r, mask in enumerate(per_rank):
        fp8_at, other_at = mask.nonzero().flatten(), (~mask).nonzero().flatten()
        byte8.append(r * length + torch.arange(counts[r]))
        at8.append(r * chunk + fp8_at)
        first = (r * length + offsets[r]) // size
        other.append(first + torch.arange(chunk - counts[r]))
        at_other.append(r * chunk + other_at)
    mine = per_rank[rank]
    at8_all = torch.cat(at8)
    return _Unit(
        a,
        length,
        torch.cat(byte8),
        at8_all,
        piece_of[at8_all],
        torch.cat(other),
        torch.cat(at_other),
        mine.nonzero().flatten(),
        piece_of[rank * chunk : (rank + 1) * chunk][mine],
        (~mine).nonzero().flatten(),
    )


class Fp8ParamGather:
    """The FP8 all-gather of one FlatState's weights (its units, dp ranks and owned chunks)."""

    def __init__(
        self,
        pieces: list[Fp8Piece],
        units: tuple[tuple[int, int], ...],
        chunk_starts: tuple[int, ...],
        dp: int,
        dp_rank: int,
        dtype: torch.dtype,
        recipe: Fp8Recipe,
        groups: tuple[Any, ...] = (),
        device: Any = None,
        delayed: Any = None,
    ):
        """delayed: delayed scaling's DelayedState (its scales quantize; pieces name its rows)."""
        self.pieces, self.dtype, self.recipe, self.groups = pieces, dtype, recipe, groups
        self.delayed, self.scale = delayed, None
        self.dp, self.chunk_starts = dp, chunk_starts
        size = torch.empty((), dtype=dtype).element_size()
        self.units = []
        for a, b in units:
            piece_of = torch.full((b - a,), -1, dtype=torch.long)
            for i, p in enumerate(pieces):
                lo, hi = max(p.start, a), min(p.start + p.numel, b)
                if lo < hi:
                    piece_of[lo - a : hi - a] = i
            unit = _unit(a, b, dp, dp_rank, piece_of, size)
            moved = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(unit).items()
            }
            self.units.append(_Unit(**moved))
        self.rows = torch.tensor([p.row if p.row is not None else 0 for p in pieces], device=device)
        self.sent = sum(u.length * dp for u in self.units)
        self.unpacked = sum((b - a) * size for a, b in units)

    def _owned(self, master: torch.Tensor) -> list[torch.Tensor]:
        """Each unit's owned chunk, as the compute weights hold it (rounded to the compute
        dtype), in fp32."""
        out = []
        for u, first in zip(self.units, self.chunk_starts):
            chunk = (u.other.numel() + u.at8.numel()) // self.dp
            out.append(master[first : first + chunk].to(self.dtype).float())
        return out

    def _amaxes(self, owned: list[torch.Tensor]) -> torch.Tensor:
        """Each piece's amax over this rank's owned chunks."""
        amax = torch.zeros(len(self.pieces), device=self.rows.device)
        for u, values in zip(self.units, owned):
            amax.scatter_reduce_(0, u.mine_piece8, values[u.mine8].abs(), "amax")
        return amax

    def record(self, master: torch.Tensor) -> None:
        """Delayed scaling: each weight's amax over the owned chunks into the state's history
        (its step-end reduction over every rank gives the whole weight's)."""
        if self.pieces and self.delayed is not None:
            self.delayed.record_rows(self.rows, 1, self._amaxes(self._owned(master)))

    def scales(self, owned: list[torch.Tensor]) -> torch.Tensor:
        """Each piece's scale: delayed scaling's, or max / the amax over groups."""
        if self.delayed is not None:
            return self.delayed.scale[self.rows, 1]
        amax = self._amaxes(owned)
        for group in self.groups:
            if group is not None and group.size > 1:
                amax = group.all_reduce(amax, "max")
        return amax_to_scale(amax, E4M3)

    def prepare(self, master: torch.Tensor) -> None:
        """The pieces' scales for the weights master holds now (every rank of groups calls it:
        tensor-wise scaling reduces over them); pack and unpack use them until forget()."""
        self.scale = self.scales(self._owned(master))

    def forget(self) -> None:
        """The weights are about to change: no scales until the next prepare()."""
        self.scale = None

    def pack(self, unit: int, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's bytes of unit (chunk: its owned elements in the compute dtype)."""
        u, values = self.units[unit], chunk.float()
        top = fp8_max(E4M3)
        packed = torch.zeros(u.length, dtype=torch.uint8, device=chunk.device)
        q = (values[u.mine8] * self.scale[u.mine_piece8]).clamp(-top, top).to(E4M3)
        packed[: q.numel()] = q.view(torch.uint8)
        rest = values[u.mine_other].to(self.dtype).view(torch.uint8)
        offset = _aligned(q.numel(), self.dtype)
        packed[offset : offset + rest.numel()] = rest
        return packed

    def unpack(self, unit: int, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's bytes of unit (pack's, all-gathered) written into out (the unit's flat
        weights), the FP8 pieces dequantized."""
        u = self.units[unit]
        fp8 = gathered[u.byte8].view(E4M3).float() / self.scale[u.piece8]
        out[u.at8] = fp8.to(self.dtype)
        out[u.at_other] = gathered.view(self.dtype)[u.other]

    def bytes_of(self, unit: int) -> int:
        """The bytes every rank gathers of unit."""
        return self.units[unit].length * self.dp

    def refresh(self, master: torch.Tensor, weights: torch.Tensor, group: Any) -> None:
        """Every unit's chunks all-gathered over group into weights: FP8 pieces as FP8 bytes,
        written dequantized (the distributed optimizer's refresh)."""
        self.prepare(master)
        pending = []
        for i, chunk in enumerate(self._owned(master)):
            out = torch.empty(self.bytes_of(i), dtype=torch.uint8, device=weights.device)
            pending.append((out, group.all_gather_into_async(out, self.pack(i, chunk))))
        for i, (out, handle) in enumerate(pending):
            handle.wait()
            u = self.units[i]
            self.unpack(i, out, weights[u.start : u.start + u.at8.numel() + u.at_other.numel()])


def _aligned(count: int, dtype: torch.dtype) -> int:
    """count bytes rounded up to a whole element of dtype."""
    size = torch.empty((), dtype=dtype).element_size()
    return -(-count // size) * size
