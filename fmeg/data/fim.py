"""Fill-in-the-middle (--fim-data), as Megatron-LM's GPTFIMDataset rearranges a GPT sample's
documents.

Each document of the sample (the runs between end-of-document tokens, which stay in place) is, with
probability --fim-rate, decoded to text, cut at two uniformly drawn character positions into prefix,
middle and suffix, re-encoded, and laid out with the FIM tokens as
    PSM   <prefix> prefix <suffix> suffix <middle> middle
        (probability 1 - --fim-spm-rate)
    SPM   <prefix> <suffix> suffix <middle> prefix middle               (probability --fim-spm-rate)
so that the model learns to write the middle after seeing both sides. A document whose text starts
with --fim-no-prefix is left alone. With --fim-split-sample TOKEN a document holding that token is,
with probability --fim-rate, cut at it into fragments (files of a repository, say), each rearranged
with probability --fim-fragment-rate. As in Megatron, an empty document (a sample that starts with
an end of document, or two in a row) is dropped with the token that ends it. The sample keeps its
length: cut at the end, or padded with the FIM pad token (whose labels are not trained on).

The draws are Megatron's, in its order, but from a generator seeded by (seed, sample index) rather
than one stream for the whole dataset: a sample is the same whatever was read before it, as every
other dataset's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FIMSettings:
    """The --fim-* flags (token names as given; FIM.of resolves them to the tokenizer's ids)."""

    rate: float = 0.5
    spm_rate: float = 0.5
    split_sample: str | None = None
    fragment_rate: float | None = None
    no_prefix: str | None = None
    prefix_token: str = "<fim_prefix>"
    middle_token: str = "<fim_middle>"
    suffix_token: str = "<fim_suffix>"
    pad_token: str = "<fim_pad>"
    eod_token: str = "<|endoftext|>"

    def problems(self) -> list[str]:
        out = [
            f"--{flag} must be in [0, 1], got {value}"
            for flag, value in (
                ("fim-rate", self.rate),
                ("fim-spm-rate", self.spm_rate),
                ("fim-fragment-rate", self.fragment_rate),
            )
            if value is not None and not 0.0 <= value <= 1.0
        ]
        if self.split_sample is not None and self.fragment_rate is None:
            out.append("--fim-split-sample needs --fim-fragment-rate (the rate for each fragment)")
        return out


@dataclass(frozen=True)
class FIM:
    """FIM settings with the tokenizer that decodes and re-encodes, and the FIM tokens' ids."""

    settings: FIMSettings
    tokenizer: object
    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None

    @classmethod
    def of(cls, settings: FIMSettings, tokenizer) -> FIM:
        """Resolve the token names; ValueError in one line naming the flags of tokens the tokenizer
        lacks."""
        lookup = getattr(tokenizer, "token_to_id", None)
        names = {
            "prefix": settings.prefix_token,
            "middle": settings.middle_token,
            "suffix": settings.suffix_token,
            "pad": settings.pad_token,
            "eod": settings.eod_token,
        }
        if settings.split_sample is not None:
            names["split"] = settings.split_sample
        ids = {k: lookup(v) if lookup else None for k, v in names.items()}
        missing = [
            f"--fim-{'split-sample' if k == 'split' else k + '-token'} {names[k]}"
            for k, v in ids.items()
            if v is None
        ]
        if missing:
            raise ValueError(
                f"--fim-data: the tokenizer has no {', '.join(missing)}; add the tokens to it or "
                "name its own with these flags"
            )
        return cls(
            settings,
            tokenizer,
            ids["prefix"],
            ids["middle"],
            ids["suffix"],
            ids["pad"],
            ids["eod"],
            ids.get("split"),
        )

    def __call__(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """The sample rearranged, cut or padded to its length."""
        out = self.rearrange(sample, rng)[: len(sample)]
        return np.concatenate([out, np.full(len(sample) - len(out), self.pad, dtype=np.int64)])

    def rearrange(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """Each document of the sample rearranged (Megatron's draws, in its order; as Megatron, an
        empty document and the end-of-document token after it are dropped)."""
        parts, start = [], 0
        for end in np.flatnonzero(sample == self.eod).tolist():
            if end > start:
                parts += [self._document(sample[start:end], rng), [self.eod]]
            start = end + 1
        parts.append(self._document(sample[start:], rng))
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])

    def _document(self, tokens: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        if self.split is None or not (tokens == self.split).any():
            return self._permute(tokens, self.settings.rate, rng)
        if not rng.binomial(1, self.settings.rate):
            return tokens
        parts, start = [], 0
        for end in np.flatnonzero(tokens == self.split).tolist():
            if end > start:
                parts += [
                    self._permute(tokens[start:end], self.settings.fragment_rate, rng),
                    [self.split],
                ]
            start = end + 1
        parts.append(self._permute(tokens[start:], self.settings.fragment_rate, rng))
        return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])

    def _permute(self, tokens: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        if not rng.binomial(1, rate):
            return tokens
        text = self.tokenizer.decode(tokens.tolist())
        if self.settings.no_prefix is not None and text.startswith(self.settings.no_prefix):
            return tokens
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2).tolist())
        prefix, middle, suffix = (
            np.asarray(self._encode(t), dtype=np.int64)
            for t in (text[:low], text[low:high], text[high:])
        )
        if rng.binomial(1, self.settings.spm_rate):
            return np.concatenate(
                [[self.prefix, self.suffix], suffix, [self.middle], prefix, middle]
            )
        return np.concatenate([[self.prefix], prefix, [self.suffix], suffix, [self.middle], middle])

    def _encode(self, text: str) -> list[int]:
        encode = getattr(self.tokenizer, "encode_plain", None) or self.tokenizer.encode
        return encode(text)


def sample_rng(seed: int, index: int) -> np.random.RandomState:
    """The generator of sample `index`'s FIM draws."""
    return np.random.RandomState(np.random.SeedSequence([seed, index]).generate_state(4))
