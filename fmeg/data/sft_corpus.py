"""Megatron-LM's SFT conversations (--sft): a JSONL file read, checked and tokenized once into an
indexed dataset.

Each line of the file is {"messages": [{"role": "system" | "user" | "assistant", "content": "..."},
...]}; a line may hold several conversations back to back, a new one starting at each system turn
(Megatron-LM's SFTDataset reads them so). Each conversation is rendered by the tokenizer's chat
template (SFTTokenizer), ends with the end-of-document token (added unless it ends with one) and is
trained on its assistant answers and that final token only. The tokenized corpus lives under the
data cache, keyed by the file and the tokenizer; a damaged line stops the run before training with
its line number and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from fmeg.data.chat_template import ChatTemplateError
from fmeg.data.indexed import IndexedDataset, IndexedDatasetBuilder
from fmeg.data.sft_tokenizer import ROLES


class SFTDataError(ValueError):
    """A JSONL line that is not a conversation; the message names the file and the line."""


def split_conversations(messages: list[dict]) -> list[list[dict]]:
    """The conversations of one line: a new one starts at each system turn (Megatron-LM's rule)."""
    out = []
    for message in messages:
        if message["role"] == "system" or not out:
            out.append([])
        out[-1].append(message)
    return out


def line_conversations(raw: bytes, where: str) -> list[list[dict]]:
    """The conversations of one JSONL line, checked: SFTDataError names `where` (file and line) and
    the fix."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SFTDataError(f"{where}: not UTF-8 (byte at column {e.start + 1})") from None
    except json.JSONDecodeError as e:
        raise SFTDataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(
            f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}'
        )
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise SFTDataError(
                f'{where}: message {i + 1} is not {{"role": {" | ".join(ROLES)}, "content": text}}'
            )
        if m["role"] == "assistant" and not m["content"].strip():
            raise SFTDataError(
                f"{where}: message {i + 1} is an empty assistant turn; give it an answer or drop it"
            )
    conversations = split_conversations(messages)
    for k, conversation in enumerate(conversations):
        if not any(m["role"] == "assistant" for m in conversation):
            which = f"conversation {k + 1}" if len(conversations) > 1 else "the conversation"
            raise SFTDataError(
                f"{where}: {which} has no assistant turn, so nothing of it would be trained on; "
                "give it an answer or drop it"
            )
    return conversations


class SFTCorpus:
    """A tokenized JSONL file: conversation c's ids (tokens[c]) and which of them are trained on
    (trained[c], 0/1), with line l's conversations line_starts[l] .. line_starts[l + 1]."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.tokens = IndexedDataset(directory / "tokens")
        self.trained = IndexedDataset(directory / "trained")
        self.line_starts = np.load(directory / "line_starts.npy", allow_pickle=False)

    @property
    def num_lines(self) -> int:
        return len(self.line_starts) - 1


def sft_corpus(path: str, tokenizer, cache_dir: str | os.PathLike) -> SFTCorpus:
    """The tokenized corpus of a JSONL file, built once under cache_dir (one builder per machine,
    LOCAL_RANK 0; the others wait for it, and stop with the builder's one line, which it leaves in a
    note named for the job, if it finds bad input)."""
    stat = os.stat(path)
    key = hashlib.md5(
        json.dumps(
            [os.path.abspath(path), stat.st_size, stat.st_mtime_ns, tokenizer.fingerprint]
        ).encode()
    ).hexdigest()
    directory = Path(cache_dir) / f"sft-{key}"
    # this job's
    failed = Path(cache_dir) / f"sft-{key}.{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}.failed"
    if not (directory / "line_starts.npy").is_file():
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            try:
                _build(path, tokenizer, directory)
            except Exception as e:
                # the others wait for a result: tell them
                if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
                    failed.write_text(
                        str(e)
                        if isinstance(e, SFTDataError)
                        else f"--data-path {path}: tokenizing failed on another rank "
                        f"({type(e).__name__})"
                    )
                raise
            failed.unlink(missing_ok=True)
        else:
            while not (directory / "line_starts.npy").is_file():
                if failed.is_file():
                    raise SFTDataError(failed.read_text())
                time.sleep(0.2)
    return SFTCorpus(directory)


def _build(path: str, tokenizer, directory: Path) -> None:
    """Tokenize every line into a temporary directory, renamed into place when complete (nothing
    half-written is left behind on bad input)."""
    tmp = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    tokens, trained = (
        IndexedDatasetBuilder(tmp / "tokens", dtype),
        IndexedDatasetBuilder(tmp / "trained", np.uint8),
    )
    line_starts, size = [0], os.path.getsize(path)
    bar = _progress(size, f"sft: tokenizing {path}")
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                bar(len(raw))
                if not raw.strip():
                    continue
                for conversation in line_conversations(raw, f"--data-path {path} line {number}"):
                    try:
                        ids, flags = tokenizer.tokenize_conversation(conversation)
                    except ChatTemplateError as e:
                        raise SFTDataError(f"--data-path {path} line {number}: {e}") from None
                    # every conversation ends a document, trained on
                    if not ids or ids[-1] != tokenizer.eod:
                        ids, flags = ids + [tokenizer.eod], flags + [True]
                    tokens.add_document(ids)
                    trained.add_document(np.asarray(flags, dtype=np.uint8))
                line_starts.append(len(tokens.sequence_lengths))
        if len(line_starts) == 1:
            raise SFTDataError(f"--data-path {path}: no conversations (an empty file)")
        tokens.finalize()
        trained.finalize()
        np.save(
            tmp / "line_starts.npy", np.asarray(line_starts, dtype=np.int64), allow_pickle=False
        )
        bar(None)
        try:
            os.replace(tmp, directory)
        # another machine's builder finished first: its files are the same
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        tokens.abort()
        trained.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _progress(total: int, label: str):
    """update(bytes) for a progress bar over a file's bytes on a terminal (tqdm when installed),
    else one line when done; update(None) closes it. Only the first rank shows it."""
    shown = int(os.environ.get("RANK", "0")) == 0
    started, bar = time.perf_counter(), None
    if shown and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, file=sys.stderr)
        except ImportError:
            pass

    def update(n):
        if n is not None:
            if bar is not None:
                bar.update(n)
            return
        if bar is not None:
            bar.close()
        elif shown:
            print(f"{label}: {total:,} bytes in {time.perf_counter() - started:.1f} s", flush=True)

    return update
