"""SFT samples (--sft): the conversations of an SFTCorpus laid into rows of seq_len tokens, each its
own document.

A sample is {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "padding_mask"}, as
GPTDataset's under --reset-position-ids --reset-attention-mask: its conversations one after another,
each attending to itself only (cu_seqlens [s + 1], padded with s) with positions restarting at 0,
each followed by padding up to a multiple of 2 x cp when cp > 1 (Megatron's granularity for context
parallelism). Padding continues the positions of the document before it, joins that document, and is
never trained on; the last document takes the row's padding. loss_mask is 1 where the label is a
token of an answer or a conversation's closing end of document; padding_mask is True where the input
token is padding (megatron-core's padding_mask: experts route those tokens, but their balance losses
and load counts leave them out).

Which conversations a sample holds:
    default
        those of one line, as Megatron-LM's SFTDataset: a line that does not fit is cut at
                            seq_len (the conversation across the cut is truncated, the ones after it
                                dropped)
    --sft-sequence-packing
        consecutive conversations of the split, as many as fit; one longer than seq_len is
                            truncated, none is dropped
Samples go through the split's lines (or packs) in file order and start again at the first when they
run out, as Megatron's SFTDataset does.
"""

from __future__ import annotations

import numpy as np
import torch

from fmeg.data.blending import BlendedDataset, parse_blend, split_document_ranges
from fmeg.data.sft_corpus import SFTCorpus, sft_corpus


def pad_granularity(cp: int) -> int:
    """Megatron's: each conversation is padded to a multiple of 2 x cp at context parallelism cp >
    1."""
    return 2 * cp if cp > 1 else 1


def packs(lengths: np.ndarray, seq_len: int, granularity: int) -> np.ndarray:
    """Start of each pack of consecutive conversations (then len(lengths)) whose padded lengths sum
    to at most seq_len; a conversation longer than seq_len is a pack of its own."""
    padded = lengths + (-lengths % granularity)
    starts, used = [0], 0
    for c, n in enumerate(padded.tolist()):
        if used and used + n > seq_len:
            starts.append(c)
            used = 0
        used += n
    return np.asarray(starts + [len(lengths)], dtype=np.int64)


def fate(lengths: np.ndarray, seq_len: int, granularity: int) -> tuple[int, int]:
    """(truncated, dropped) conversations of one sample: a conversation survives whole when its last
    token lies before position seq_len (the row's last token is only a label, and is padding after a
    cut)."""
    ends = np.cumsum(lengths + (-lengths % granularity)) if len(lengths) else np.zeros(0, np.int64)
    starts = ends - lengths - (-lengths % granularity)
    ends_real = starts + lengths
    truncated = int(((starts < seq_len) & (ends_real > seq_len)).sum())
    return truncated, int((starts >= seq_len).sum())


class SFTDataset(torch.utils.data.Dataset):
    """num_samples samples of seq_len tokens from the lines [first_line, end_line) of an
    SFTCorpus."""

    def __init__(
        self,
        corpus: SFTCorpus,
        lines: tuple[int, int],
        seq_len: int,
        num_samples: int,
        *,
        pad: int,
        cp: int = 1,
        packing: bool = False,
    ):
        self.corpus, self.seq_len, self.num_samples, self.pad = corpus, seq_len, num_samples, pad
        self.granularity = pad_granularity(cp)
        first, last = (int(corpus.line_starts[i]) for i in lines)
        if packing:
            lengths = corpus.tokens.sequence_lengths[first:last].astype(np.int64)
            self.group_starts = first + packs(lengths, seq_len, self.granularity)
        else:
            self.group_starts = corpus.line_starts[lines[0] : lines[1] + 1].astype(np.int64)
        used = self.group_starts[: min(num_samples, len(self.group_starts) - 1) + 1]
        self.conversations = int(used[-1] - used[0])
        self.truncated = self.dropped = 0
        for a, b in zip(used[:-1].tolist(), used[1:].tolist()):
            t, d = fate(
                corpus.tokens.sequence_lengths[a:b].astype(np.int64), seq_len, self.granularity
            )
            self.truncated, self.dropped = self.truncated + t, self.dropped + d

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = i % (len(self.group_starts) - 1)
        s, pad, step = self.seq_len, self.pad, self.granularity
        tokens, trained, padded, positions, ends, total = [], [], [], [], [], 0
        for c in range(int(self.group_starts[g]), int(self.group_starts[g + 1])):
            ids, flags = self.corpus.tokens[c], self.corpus.trained[c]
            extra = -len(ids) % step
            tokens += [ids, np.full(extra, pad)]
            trained += [flags, np.zeros(extra, np.uint8)]
            padded += [np.zeros(len(ids), bool), np.ones(extra, bool)]
            positions.append(np.arange(len(ids) + extra))
            total += len(ids) + extra
            ends.append(total)
            # cut: the row's last token, a label only, becomes padding
            if total >= s + 1:
                break
        tokens, trained = (
            np.concatenate(tokens).astype(np.int64),
            np.concatenate(trained).astype(np.float32),
        )
        positions, padded = np.concatenate(positions), np.concatenate(padded)
        if total >= s + 1:
            tokens, trained, positions, padded = (
                tokens[: s + 1],
                trained[: s + 1],
                positions[: s + 1],
                padded[: s + 1],
            )
            tokens[s], trained[s], padded[s] = pad, 0.0, True
        else:
            more = s + 1 - total
            tokens = np.concatenate([tokens, np.full(more, pad)])
            trained = np.concatenate([trained, np.zeros(more, np.float32)])
            padded = np.concatenate([padded, np.ones(more, bool)])
            positions = np.concatenate([positions, positions[-1] + 1 + np.arange(more)])
        cu_seqlens = np.full(s + 1, s, dtype=np.int64)
        cu_seqlens[0] = 0
        # the last document runs to the row's end
        cu_seqlens[1 : len(ends)] = ends[:-1]
        return {
            "tokens": torch.from_numpy(tokens[:-1].copy()),
            "labels": torch.from_numpy(tokens[1:].copy()),
            "loss_mask": torch.from_numpy(trained[1:].copy()),
            "position_ids": torch.from_numpy(positions[:-1].astype(np.int64)),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
            "padding_mask": torch.from_numpy(padded[:-1].copy()),
        }


def build_sft_datasets(
    data_path: list[str] | str,
    split: str,
    seq_len: int,
    num_samples: list[int],
    tokenizer,
    *,
    cache_dir,
    cp: int = 1,
    packing: bool = False,
    surplus: float = 0.005,
) -> tuple[list, list[str]]:
    """([train, valid, test] SFT datasets of --data-path's JSONL files (None where a split is empty
    or needs no samples), one line for each split that truncates or drops conversations). --split
    divides each file's lines as Megatron divides its rows; a blend ('30 a.jsonl 70 b.jsonl')
    interleaves files by weight as build_datasets does."""
    paths, weights = parse_blend(data_path)
    corpora = [sft_corpus(p, tokenizer, cache_dir) for p in paths]
    out, said = [], []
    for i, (name, wanted) in enumerate(zip(("train", "valid", "test"), num_samples)):
        ranges = [split_document_ranges(split, c.num_lines)[i] for c in corpora]
        if not wanted or any(r is None or r[0] == r[1] for r in ranges):
            out.append(None)
            continue
        parts = [
            SFTDataset(
                c,
                r,
                seq_len,
                wanted if len(corpora) == 1 else int(np.ceil(w * wanted * (1 + surplus))),
                pad=tokenizer.pad,
                cp=cp,
                packing=packing,
            )
            for c, w, r in zip(corpora, weights, ranges)
        ]
        for path, part in zip(paths, parts):
            if part.truncated or part.dropped:
                said.append(
                    f"--data-path {path}: {part.truncated} of the {name} split's "
                    f"{part.conversations} conversations are cut at --seq-length {seq_len} and "
                    f"{part.dropped} dropped after a cut"
                    + (
                        ""
                        if packing
                        else "; --sft-sequence-packing keeps them whole where they fit"
                    )
                )
        out.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, wanted))
    return out, said
