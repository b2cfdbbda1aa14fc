"""Tokenizers: bytes (no dependency), or files through the Hugging Face `tokenizers` package.

    ByteTokenizer()                                 ids 0..255 are bytes, 256 is end-of-document
    HuggingFaceTokenizer("tokenizer.json")          any tokenizers-library file
    GPT2BPETokenizer("vocab.json", "merges.txt")    GPT-2's byte-level BPE files

Each has encode(text) -> list[int], decode(ids) -> str, vocab_size and eod (the end-of-document id).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def padded_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = 128) -> int:
    """Megatron's padding: the next multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


class ByteTokenizer:
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron's NullTokenizer: text is token ids separated by spaces; ids 0 .. vocab_size - 1 are the
    vocabulary (--vocab-size) and vocab_size itself is the end-of-document id, so there are vocab_size + 1."""

    def __init__(self, vocab_size: int):
        if vocab_size <= 0:
            raise ValueError(f"--tokenizer-type NullTokenizer needs a positive --vocab-size, got {vocab_size}")
        self.eod, self.vocab_size = vocab_size, vocab_size + 1

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class Llama2Tokenizer:
    """Megatron's Llama2Tokenizer: a sentencepiece model (pip install sentencepiece); encode prepends the
    beginning-of-sequence id as Megatron's does, and the end-of-sequence id is the end of document."""

    def __init__(self, model_file: str):
        try:
            import sentencepiece
        except ImportError as e:
            raise ValueError("--tokenizer-type Llama2Tokenizer needs sentencepiece: pip install sentencepiece") from e
        if not os.path.isfile(model_file):
            raise ValueError(f"--tokenizer-model {model_file}: no such file")
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size, self.eod, self.bos = self._sp.get_piece_size(), self._sp.eos_id(), self._sp.bos_id()

    def encode(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)]

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer:
    def __init__(self, path: str, eod_token: str | None = None):
        from tokenizers import Tokenizer

        if not Path(path).is_file():
            raise ValueError(f"--tokenizer-model {path}: no such file")
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = _find_eod(self._tok, eod_token, path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


class GPT2BPETokenizer(HuggingFaceTokenizer):
    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        self._tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = _find_eod(self._tok, "<|endoftext|>", vocab_file)


def _find_eod(tok, name: str | None, path) -> int:
    for candidate in ([name] if name else []) + ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]:
        ident = tok.token_to_id(candidate)
        if ident is not None:
            return ident
    raise ValueError(f"{path}: no end-of-document token found (tried {name or ''} <|endoftext|> </s> <eos>); "
                     "name one with --eod-token")


def build_tokenizer(kind: str, *, model: str | None = None, vocab_file: str | None = None,
                    merge_file: str | None = None, eod_token: str | None = None, vocab_size: int | None = None):
    """The tokenizer named by --tokenizer-type and its file flags."""
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if kind == "Llama2Tokenizer":
        if not model:
            raise ValueError("--tokenizer-type Llama2Tokenizer needs --tokenizer-model PATH/tokenizer.model")
        return Llama2Tokenizer(model)
    if kind == "HuggingFaceTokenizer":
        if not model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json")
        return HuggingFaceTokenizer(model, eod_token)
    if kind == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    raise ValueError(f"--tokenizer-type {kind!r}: expected ByteTokenizer, NullTokenizer, Llama2Tokenizer, "
                     "HuggingFaceTokenizer or GPT2BPETokenizer")
