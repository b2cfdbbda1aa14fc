"""Tokenizers: bytes (no dependency), or files through the Hugging Face `tokenizers` package.

    ByteTokenizer()                                 ids 0..255 are bytes, 256 is end-of-document
    HuggingFaceTokenizer("tokenizer.json")          any tokenizers-library file
    GPT2BPETokenizer("vocab.json", "merges.txt")    GPT-2's byte-level BPE files
    NullTokenizer(vocab_size), Llama2Tokenizer("tokenizer.model"), TikTokenizer("vocab.json")
        as Megatron's
    SFTTokenizer("hf_dir", prompt_format)
        a directory and its chat template (fmeg.data.sft_tokenizer)

Each has encode(text) -> list[int], decode(ids) -> str, vocab_size and eod (the end-of-document id).
"""

from __future__ import annotations

import base64
import json
import math
import os
from pathlib import Path

TOKENIZER_TYPES = [
    "ByteTokenizer",
    "NullTokenizer",
    "Llama2Tokenizer",
    "GPTSentencePieceTokenizer",
    "TikTokenizer",
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "SFTTokenizer",
]


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
    """Megatron's NullTokenizer: text is token ids separated by spaces; --vocab-size N gives N ids,
    the last of which, N - 1, is the end of document (current Megatron builds it from N - 1;
    megatron-core 0.16's legacy _NullTokenizer counted N + 1 ids with end of document N)."""

    def __init__(self, vocab_size: int):
        if vocab_size <= 1:
            raise ValueError(
                "--tokenizer-type NullTokenizer needs a --vocab-size of at least 2, got "
                f"{vocab_size}"
            )
        self.eod, self.vocab_size = vocab_size - 1, vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class Llama2Tokenizer:
    """Megatron's Llama2Tokenizer: a sentencepiece model (pip install sentencepiece); encode
    prepends the beginning-of-sequence id as Megatron's does, and the end-of-sequence id is the end
    of document."""

    name = "Llama2Tokenizer"

    def __init__(self, model_file: str):
        try:
            import sentencepiece
        except ImportError as e:
            raise ValueError(
                f"--tokenizer-type {self.name} needs sentencepiece: pip install sentencepiece"
            ) from e
        if not os.path.isfile(model_file):
            raise ValueError(f"--tokenizer-model {model_file}: no such file")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        # sentencepiece's own parse errors
        except (RuntimeError, OSError) as e:
            raise ValueError(
                f"--tokenizer-model {model_file}: not a sentencepiece model ({_first_line(e)})"
            ) from None
        self.vocab_size, self.eod, self.bos = (
            self._sp.get_piece_size(),
            self._sp.eos_id(),
            self._sp.bos_id(),
        )

    def encode(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)]

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class GPTSentencePieceTokenizer(Llama2Tokenizer):
    """Megatron's GPTSentencePieceTokenizer: a sentencepiece model whose encode adds nothing (no
    beginning-of-sequence id, unlike Llama2Tokenizer); the end-of-sequence id is the end of
    document."""

    name = "GPTSentencePieceTokenizer"

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))


# Megatron's two tiktoken pre-tokenizer patterns (--tiktoken-pattern v1 | v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class TikTokenizer:
    """Megatron's TikTokenizer (pip install tiktoken): a byte-level BPE read from a JSON list of
    {"rank", "token_bytes" (base64), "token_str"} entries, ranks 0..255 being the single bytes.

    Ids 0 .. num_special_tokens - 1 are special: the given special tokens (default <unk>, <s>,
    </s>), then <SPECIAL_i> fillers; vocabulary rank r is id r + num_special_tokens, and the
    vocabulary is cut so that there are vocab_size ids in all (--vocab-size, Megatron's default
    2**17). </s> ends a document. Text is encoded as ordinary text: a special token's name in the
    text is not its id."""

    def __init__(
        self,
        path: str,
        pattern: str | None = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = 1000,
        special_tokens: list[str] | None = None,
    ):
        try:
            import tiktoken
        except ImportError as e:
            raise ValueError(
                "--tokenizer-type TikTokenizer needs tiktoken: pip install tiktoken"
            ) from e
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern}: expected v1 or v2")
        self.vocab_size = 2**17 if vocab_size is None else vocab_size
        specials = list(special_tokens or ["<unk>", "<s>", "</s>"])
        missing = [t for t in ("<unk>", "<s>", "</s>") if t not in specials]
        if missing or len(set(specials)) != len(specials):
            raise ValueError(
                "--tiktoken-special-tokens must be distinct and include <unk> <s> </s>, got "
                f"{specials}"
            )
        if not len(specials) <= num_special_tokens < self.vocab_size:
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the "
                f"{len(specials)} special tokens and below the vocabulary of {self.vocab_size}"
            )
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        ranks = _mergeable_ranks(path, self.vocab_size - num_special_tokens)
        self.eod = specials.index("</s>")
        self._bpe = tiktoken.Encoding(
            name=Path(path).parent.name or "tiktoken",
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={b: r + num_special_tokens for b, r in ranks.items()},
            special_tokens={t: i for i, t in enumerate(specials)},
        )

    def encode(self, text: str) -> list[int]:
        return self._bpe.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._bpe.decode([int(i) for i in ids])


def _mergeable_ranks(path: str, size: int) -> dict[bytes, int]:
    """{token bytes: rank} of the first `size` entries of a tiktoken JSON vocabulary, checked."""
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"--tokenizer-model {path}: not a tiktoken JSON vocabulary ({e})"
        ) from None
    if not isinstance(entries, list):
        raise ValueError(
            f"--tokenizer-model {path}: expected a JSON list of {{rank, token_bytes, token_str}}"
        )
    if len(entries) < size:
        raise ValueError(
            f"--tokenizer-model {path} has {len(entries)} tokens, fewer than the {size} that "
            "--vocab-size minus --tiktoken-num-special-tokens asks for; lower --vocab-size"
        )
    ranks = {}
    for i, entry in enumerate(entries[:size]):
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
            good = entry["rank"] == i and (i >= 256 or token == bytes([i])) and token not in ranks
        except (TypeError, KeyError, ValueError):
            good = False
        if not good:
            raise ValueError(
                f"--tokenizer-model {path}: entry {i} is not rank {i} with new base64 token_bytes "
                "(ranks 0..255 must be the single bytes)"
            )
        ranks[token] = i
    return ranks


class HuggingFaceTokenizer:
    """A tokenizers-library file, or a directory holding one as tokenizer.json (a saved Hugging Face
    tokenizer or a downloaded model's directory, which Megatron's HuggingFaceTokenizer also takes;
    hub names are not looked up: fmeg never reaches for the network). As transformers'
    AutoTokenizer, which Megatron's uses: encode adds what the tokenizer's post-processor adds
    (Llama 3's <|begin_of_text|>; nothing for Qwen), and a directory's tokenizer_config.json names
    the end of document (its eos_token)."""

    def __init__(self, path: str, eod_token: str | None = None):
        from tokenizers import Tokenizer

        if Path(path).is_dir():
            if not (Path(path) / "tokenizer.json").is_file():
                raise ValueError(f"--tokenizer-model {path}: a directory without tokenizer.json")
            eod_token = eod_token or _config_eos(Path(path) / "tokenizer_config.json")
            path = str(Path(path) / "tokenizer.json")
        elif not Path(path).is_file():
            raise ValueError(
                f"--tokenizer-model {path}: no such file or directory (hub names are not "
                "downloaded; give a local tokenizer.json or the directory holding it)"
            )
        try:
            self._tok = Tokenizer.from_file(str(path))
        # the tokenizers library raises plain Exception for a file it cannot parse
        except Exception as e:
            raise ValueError(
                f"--tokenizer-model {path}: not a tokenizers-library file ({_first_line(e)})"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = _find_eod(self._tok, eod_token, path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_plain(self, text: str) -> list[int]:
        """The text's ids with nothing added (no beginning-of-text token): a piece of a document."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # special tokens kept, as transformers' decode keeps them by default
    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _config_eos(config: Path) -> str | None:
    """tokenizer_config.json's eos_token (a string, or {"content": ...}), when the file has one."""
    try:
        eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--tokenizer-model {config}: not readable JSON ({_first_line(e)})"
        ) from None
    return eos.get("content") if isinstance(eos, dict) else eos


class GPT2BPETokenizer(HuggingFaceTokenizer):
    def __init__(self, vocab_file: str, merge_file: str):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        try:
            self._tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        # plain Exception from the tokenizers library
        except Exception as e:
            raise ValueError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: not GPT-2 BPE files "
                f"({_first_line(e)})"
            ) from None
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = _find_eod(self._tok, "<|endoftext|>", vocab_file)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _find_eod(tok, name: str | None, path) -> int:
    for candidate in ([name] if name else []) + [
        "<|endoftext|>",
        "</s>",
        "<eos>",
        "<|end_of_text|>",
    ]:
        ident = tok.token_to_id(candidate)
        if ident is not None:
            return ident
    raise ValueError(
        f"{path}: no end-of-document token found (tried {name or ''} <|endoftext|> </s> <eos>); "
        "name one with --eod-token"
    )


def build_tokenizer(
    kind: str,
    *,
    model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    eod_token: str | None = None,
    vocab_size: int | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int | None = None,
    tiktoken_special_tokens: list[str] | None = None,
    sft_prompt_format: str | None = None,
):
    """The tokenizer named by --tokenizer-type and its file flags."""
    if kind == "ByteTokenizer":
        return ByteTokenizer()
    if kind == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if kind in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"):
        if not model:
            raise ValueError(
                f"--tokenizer-type {kind} needs --tokenizer-model PATH/tokenizer.model"
            )
        return (Llama2Tokenizer if kind == "Llama2Tokenizer" else GPTSentencePieceTokenizer)(model)
    if kind == "TikTokenizer":
        if not model or not tiktoken_pattern:
            raise ValueError(
                "--tokenizer-type TikTokenizer needs --tokenizer-model PATH.json and "
                "--tiktoken-pattern v1|v2"
            )
        return TikTokenizer(
            model,
            tiktoken_pattern,
            vocab_size,
            1000 if tiktoken_num_special_tokens is None else tiktoken_num_special_tokens,
            tiktoken_special_tokens,
        )
    if kind == "HuggingFaceTokenizer":
        if not model:
            raise ValueError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json"
            )
        return HuggingFaceTokenizer(model, eod_token)
    if kind == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise ValueError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
            )
        return GPT2BPETokenizer(vocab_file, merge_file)
    if kind == "SFTTokenizer":
        from fmeg.data.sft_tokenizer import SFTTokenizer

        if not model:
            raise ValueError(
                "--tokenizer-type SFTTokenizer needs --tokenizer-model HF_DIR (a Hugging Face "
                "tokenizer directory)"
            )
        return SFTTokenizer(model, sft_prompt_format)
    raise ValueError(f"--tokenizer-type {kind!r}: expected one of {', '.join(TOKENIZER_TYPES)}")


def tokenizer_from_flags(kind: str, flag) -> object:
    """build_tokenizer with its files and options read by flag(name), name as argparse stores the
    flag (tokenizer_model, vocab_file, ..., tiktoken_special_tokens); None for a flag the recipe
    lacks."""
    return build_tokenizer(
        kind,
        model=flag("tokenizer_model"),
        vocab_file=flag("vocab_file"),
        merge_file=flag("merge_file"),
        eod_token=flag("eod_token"),
        vocab_size=flag("vocab_size"),
        tiktoken_pattern=flag("tiktoken_pattern"),
        tiktoken_num_special_tokens=flag("tiktoken_num_special_tokens"),
        tiktoken_special_tokens=flag("tiktoken_special_tokens"),
        sft_prompt_format=flag("sft_tokenizer_prompt_format"),
    )
