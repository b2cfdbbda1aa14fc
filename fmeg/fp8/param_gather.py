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
class _Runs:
    """A rank's chunk as runs: FP8 runs [first, end) with their pieces and other runs [first,
    end) (unit positions), and the FP8 runs' pieces and lengths as tensors."""

    fp8: tuple[tuple[int, int, int], ...]
    other: tuple[tuple[int, int], ...]
    pieces: torch.Tensor
    lengths: torch.Tensor

    @property
    def fp8_count(self) -> int:
        return sum(e - f for f, e, _ in self.fp8)


@dataclass(frozen=True)
class _Unit:
    """One unit's byte layout: rank r sends its chunk's FP8 elements (one byte each), then, from a
    byte offset aligned to the compute dtype, its other elements; each rank sends `length`."""

    start: int
    numel: int
    length: int
    ranks: tuple[_Runs, ...]
    # every rank's FP8 runs' pieces and lengths, rank after rank (unpack's)
    pieces: torch.Tensor
    lengths: torch.Tensor
    split: tuple[int, ...]


def _chunk_runs(lo: int, hi: int, pieces: list[Fp8Piece], a: int, device) -> _Runs:
    """The runs of flat elements [lo, hi), in unit positions (minus a)."""
    fp8, other, at = [], [], lo
    for i, p in sorted(enumerate(pieces), key=lambda ip: ip[1].start):
        first, end = max(p.start, lo), min(p.start + p.numel, hi)
        if first >= end:
            continue
        if first > at:
            other.append((at - a, first - a))
        fp8.append((first - a, end - a, i))
        at = end
    if at < hi:
        other.append((at - a, hi - a))
    index = torch.tensor([i for _, _, i in fp8], dtype=torch.long, device=device)
    lengths = torch.tensor([e - f for f, e, _ in fp8], dtype=torch.long, device=device)
    return _Runs(tuple(fp8), tuple(other), index, lengths)


def _unit(a: int, b: int, dp: int, pieces: list[Fp8Piece], size: int, device) -> _Unit:
    chunk = (b - a) // dp
    ranks = tuple(
        _chunk_runs(a + r * chunk, a + (r + 1) * chunk, pieces, a, device) for r in range(dp)
    )
    length = max(_aligned(r.fp8_count, size) + (chunk - r.fp8_count) * size for r in ranks)
    return _Unit(
        a,
        b - a,
        _aligned(length, size),
        ranks,
        torch.cat([r.pieces for r in ranks]),
        torch.cat([r.lengths for r in ranks]),
        tuple(e - f for r in ranks for f, e, _ in r.fp8),
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
        self.dp, self.rank, self.chunk_starts = dp, dp_rank, chunk_starts
        self.size = size = torch.empty((), dtype=dtype).element_size()
        self.units = [_unit(a, b, dp, pieces, size, device) for a, b in units]
        self.rows = torch.tensor([p.row if p.row is not None else 0 for p in pieces], device=device)
        self.sent = sum(u.length * dp for u in self.units)
        self.unpacked = sum((b - a) * size for a, b in units)

    def _owned(self, master: torch.Tensor) -> list[torch.Tensor]:
        """Each unit's owned chunk as the compute weights hold it (in the compute dtype)."""
        return [
            master[first : first + u.numel // self.dp].to(self.dtype)
            for u, first in zip(self.units, self.chunk_starts)
        ]

    def _amaxes(self, owned: list[torch.Tensor]) -> torch.Tensor:
        """Each piece's amax over this rank's owned chunks."""
        amax = torch.zeros(len(self.pieces), device=self.rows.device)
        for u, values in zip(self.units, owned):
            mine, base = u.ranks[self.rank], self.rank * (u.numel // self.dp)
            if mine.fp8:
                runs = [values[f - base : e - base].abs().amax() for f, e, _ in mine.fp8]
                amax.scatter_reduce_(0, mine.pieces, torch.stack(runs).float(), "amax")
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
        u = self.units[unit]
        mine, base = u.ranks[self.rank], self.rank * (u.numel // self.dp)
        packed = torch.zeros(u.length, dtype=torch.uint8, device=chunk.device)
        n8 = mine.fp8_count
        if n8:
            x = torch.cat([chunk[f - base : e - base] for f, e, _ in mine.fp8]).float()
            scale = self.scale[mine.pieces].repeat_interleave(mine.lengths, output_size=n8)
            top = fp8_max(E4M3)
            packed[:n8] = (x * scale).clamp(-top, top).to(E4M3).view(torch.uint8)
        if mine.other:
            rest = torch.cat([chunk[f - base : e - base] for f, e in mine.other])
            offset = _aligned(n8, self.size)
            packed[offset : offset + rest.numel() * self.size] = rest.view(torch.uint8)
        return packed

    def unpack(self, unit: int, gathered: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's bytes of unit (pack's, all-gathered) written into out (the unit's flat
        weights), the FP8 pieces dequantized: a few kernels per unit, whatever its runs."""
        u = self.units[unit]
        fp8_bytes, fp8_views, other_values, other_views = [], [], [], []
        for r, runs in enumerate(u.ranks):
            n8, sent = runs.fp8_count, gathered[r * u.length : (r + 1) * u.length]
            fp8_bytes.append(sent[:n8])
            fp8_views += [out[f:e] for f, e, _ in runs.fp8]
            sizes = [e - f for f, e in runs.other]
            rest = sent[_aligned(n8, self.size) :].view(self.dtype)[: sum(sizes)]
            other_values += list(rest.split(sizes))
            other_views += [out[f:e] for f, e in runs.other]
        if fp8_views:
            total = sum(u.split)
            scale = self.scale[u.pieces].repeat_interleave(u.lengths, output_size=total)
            values = torch.cat(fp8_bytes).view(E4M3).float() / scale
            torch._foreach_copy_(fp8_views, list(values.to(self.dtype).split(u.split)))
        if other_views:
            torch._foreach_copy_(other_views, other_values)

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
            self.unpack(i, out, weights[u.start : u.start + u.numel])


def _aligned(count: int, size: int) -> int:
    """count bytes rounded up to a whole element of size bytes."""
    return -(-count // size) * size
