"""Tokenize JSON lines once into Megatron's indexed format.

    python -m recipes.preprocess_data --input corpus.jsonl --output-prefix data/corpus --append-eod
    python -m recipes.preprocess_data --input c.jsonl --output-prefix out --tokenizer-type
        GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --workers 4

Writes {output_prefix}_{key}_document.bin/.idx for every --json-keys key (Megatron's names), one
document per line. Lines that are not JSON, lack a key or hold a non-string are skipped, counted and
reported with their line numbers (--strict stops at the first instead, leaving no output). Files
appear only when complete.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

from fmeg.cli import OneLineParser
from fmeg.data.indexed import IndexedDatasetBuilder, best_dtype
from fmeg.data.tokenizers import TOKENIZER_TYPES, tokenizer_from_flags

_TOKENIZER = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(
        prog="python -m recipes.preprocess_data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", required=True, help="JSON lines file")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--append-eod",
        action="store_true",
        help="end every document with the end-of-document token",
    )
    p.add_argument("--tokenizer-type", default="ByteTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument(
        "--vocab-size",
        type=int,
        help="NullTokenizer's vocabulary (text is space-separated ids); "
        "TikTokenizer's ids in all (default 2**17)",
    )
    p.add_argument(
        "--tokenizer-model",
        help="tokenizer.json for HuggingFaceTokenizer, tokenizer.model for "
        "Llama2Tokenizer, the JSON vocabulary for TikTokenizer",
    )
    p.add_argument("--tiktoken-pattern", choices=["v1", "v2"])
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    p.add_argument("--tiktoken-special-tokens", nargs="+")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--eod-token", help="name of the end-of-document token if not a usual one")
    p.add_argument(
        "--log-interval", type=int, default=10000, help="report progress every N documents"
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad line")
    return p.parse_args(argv)


def _tokenizer_from(args: argparse.Namespace):
    return tokenizer_from_flags(args.tokenizer_type, lambda name: getattr(args, name, None))


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER
    _TOKENIZER = _tokenizer_from(args)


def encode_line(task: tuple[int, bytes, list[str], bool]) -> tuple[int, dict | str, int]:
    """(line number, {key: ids} or the problem, bytes read) for one JSON line (as read: bytes)."""
    number, raw, keys, append_eod = task
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return number, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})", len(raw)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return number, f"invalid JSON ({e.msg} at column {e.colno})", len(raw)
    if not isinstance(record, dict):
        return number, "not a JSON object", len(raw)
    out = {}
    for key in keys:
        if key not in record:
            return number, f"no key {key!r}", len(raw)
        if not isinstance(record[key], str):
            return number, f"key {key!r} holds {type(record[key]).__name__}, not a string", len(raw)
        ids = _TOKENIZER.encode(record[key])
        out[key] = ids + [_TOKENIZER.eod] if append_eod else ids
    return number, out, len(raw)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not Path(args.input).is_file():
            raise ValueError(f"--input {args.input}: no such file")
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        tokenizer = _tokenizer_from(args)
        Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"error: --output-prefix {args.output_prefix}: cannot create its directory "
            f"({e.strerror or e})",
            file=sys.stderr,
        )
        return 2
    _init_worker(args)
    dtype = best_dtype(tokenizer.vocab_size)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders: dict[str, IndexedDatasetBuilder] = {}
    try:
        return _build(args, prefixes, builders, dtype)
    # a full disk, a read-only directory: one line, and nothing half-written
    except OSError as e:
        for builder in builders.values():
            builder.abort()
        print(
            f"error: --output-prefix {args.output_prefix}: cannot write the dataset "
            f"({e.strerror or e}); nothing was written",
            file=sys.stderr,
        )
        return 2


def _build(args, prefixes: dict[str, str], builders: dict, dtype) -> int:
    for key, prefix in prefixes.items():
        builders[key] = IndexedDatasetBuilder(prefix, dtype)
    bad: list[tuple[int, str]] = []
    docs = tokens = read = 0
    start = time.perf_counter()

    def tasks():
        # decoded line by line, so a bad byte names its line
        with open(args.input, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield number, line, args.json_keys, args.append_eod

    pool = multiprocessing.Pool(args.workers, _init_worker, (args,)) if args.workers > 1 else None
    try:
        results = (
            pool.imap(encode_line, tasks(), chunksize=64) if pool else map(encode_line, tasks())
        )
        for number, result, size in results:
            read += size
            if isinstance(result, str):
                bad.append((number, result))
                if args.strict:
                    raise ValueError(
                        f"{args.input}:{number}: {result} (without --strict such lines are skipped)"
                    )
                continue
            for key, ids in result.items():
                builders[key].add_document(ids)
                tokens += len(ids)
            docs += 1
            if docs % args.log_interval == 0:
                elapsed = time.perf_counter() - start
                print(
                    f"processed {docs} documents ({docs / elapsed:.0f} docs/s, "
                    f"{read / elapsed / 1e6:.1f} MB/s)",
                    file=sys.stderr,
                    flush=True,
                )
    except ValueError as e:
        for builder in builders.values():
            builder.abort()
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if pool:
            pool.close()
            pool.join()
    # a dataset of no documents trains nothing: refuse it rather than write it
    if docs == 0:
        for builder in builders.values():
            builder.abort()
        why = (
            f"all {len(bad)} lines were skipped, the first {args.input}:{bad[0][0]}: {bad[0][1]}"
            if bad
            else "it has no non-blank lines"
        )
        print(
            f"error: --input {args.input}: no documents ({why}); nothing was written",
            file=sys.stderr,
        )
        return 2
    for builder in builders.values():
        builder.finalize()
    elapsed = time.perf_counter() - start
    print(
        f"done: {docs} documents, {tokens} tokens in {elapsed:.1f} s "
        f"({tokens / max(elapsed, 1e-9):,.0f} tokens/s, {docs / max(elapsed, 1e-9):,.0f} "
        f"documents/s); {len(bad)} bad lines skipped"
    )
    for number, problem in bad[:10]:
        print(f"  {args.input}:{number}: {problem}")
    if len(bad) > 10:
        print(f"  ... and {len(bad) - 10} more")
    for key, prefix in prefixes.items():
        print(f"  {key}: {prefix}.bin / .idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
