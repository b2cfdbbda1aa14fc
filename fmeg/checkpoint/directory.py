"""The checkpoint directory: iterations written aside and renamed into place, the newest named by a
pointer file.

    DIR/iter_0000010.tmp-<attempt>/
        a save in progress (a token the ranks of one run share, new every run)
    DIR/iter_0000010/
        a complete checkpoint: every rank's files, then metadata.json (written last)
    DIR/latest_checkpointed_iteration.txt
        the newest complete iteration (Megatron's name; moved last)

A killed save leaves only a temporary directory, which loading ignores and a restart never writes
into; remove_stale deletes such leftovers when a run starts. Files are fsynced before the rename and
the directories after it, so a checkpoint that the pointer names was on disk whole before the
pointer moved.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

LATEST = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file (and the tensor)."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def temporary_dir(root: str | os.PathLike, iteration: int, attempt: str) -> Path:
    return Path(root) / f"iter_{iteration:07d}.tmp-{attempt}"


_COMPLETE = re.compile(r"iter_\d{7}")
# older fmeg wrote ".tmp" alone
_TEMPORARY = re.compile(r"iter_\d{7}\.tmp(-[0-9a-f]+)?")


def _ours(root: str | os.PathLike, pattern: re.Pattern) -> list[Path]:
    """The directories under root whose names are exactly fmeg's (never a user's iter_0000004.bak, a
    file or a symlink)."""
    return (
        sorted(
            p
            for p in Path(root).iterdir()
            if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
        )
        if Path(root).is_dir()
        else []
    )


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """Write and fsync a small file through a temporary name, so that it is whole or absent."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_stale(root: str | os.PathLike) -> list[str]:
    """Delete the temporary directories that interrupted saves left under root; returns their names.
    Call it before this run's first save (every temporary directory is then some dead run's)."""
    stale = _ours(root, _TEMPORARY)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]


def finalize(
    root: str | os.PathLike,
    iteration: int,
    metadata: dict,
    keep_last: int | None = None,
    attempt: str = "0",
) -> Path:
    """On one rank, after every rank wrote its files (rank_XXXXX.json each): write metadata.json
    with every rank's entry, rename the directory into place, then move the latest pointer;
    optionally delete all but the newest keep_last checkpoints."""
    root = Path(root)
    tmp, final = temporary_dir(root, iteration, attempt), iteration_dir(root, iteration)
    ranks = sorted(
        (json.loads(p.read_text()) for p in tmp.glob("rank_*.json")), key=lambda r: r["rank"]
    )
    if len(ranks) != metadata["world_size"]:
        raise CheckpointError(
            f"{tmp}: {len(ranks)} rank files for a world of {metadata['world_size']}"
        )
    metadata = {
        **metadata,
        "iteration": iteration,
        "files": {f"rank_{r['rank']:05d}.safetensors": r for r in ranks},
    }
    # every rank reads it
    write_text(tmp / METADATA, json.dumps(metadata, sort_keys=True, separators=(",", ":")))
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    write_text(root / LATEST, str(iteration))
    fsync_dir(root)
    if keep_last:
        prune(root, keep_last)
    return final


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints under root; returns the names
    deleted."""
    done = _ours(root, _COMPLETE)
    for old in done[:-keep] if keep > 0 else done:
        shutil.rmtree(old)
    return [p.name for p in (done[:-keep] if keep > 0 else done)]


def disk_bytes(path: str | os.PathLike) -> int:
    """The bytes of the files under a directory (a checkpoint's size on disk)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under root (partial directories are ignored with a
    warning)."""
    root = Path(root)
    for partial in _ours(root, _TEMPORARY):
        warnings.warn(f"{partial}: an unfinished checkpoint (a save was interrupted); ignoring it")
    pointer = root / LATEST
    if (root / METADATA).is_file() and not pointer.is_file():
        raise CheckpointError(
            f"{root} is one iteration of a checkpoint; give the directory that holds it "
            f"({root.parent}), which names its newest iteration in {LATEST}"
        )
    if not pointer.is_file():
        return None
    text = pointer.read_text(errors="replace").strip()
    if not text.isdigit() and text != "release":
        raise CheckpointError(
            f"{pointer}: holds {text[:40]!r}, not an iteration number; write the number of a "
            "complete iteration directory there, or delete the file to start from scratch"
        )
    # release: Megatron's converters'
    path = root / "release" if text == "release" else iteration_dir(root, int(text))
    if not (path / METADATA).is_file():
        # Megatron's legacy --ckpt-format torch files: fmeg.interop.megatron reads them
        if any(path.glob("mp_rank_*/model_optim_rng.pt")):
            return path
        if any(path.glob("mp_rank_*")):
            raise CheckpointError(
                f"{path}: mp_rank_* directories without their model_optim_rng.pt: an incomplete "
                "Megatron --ckpt-format torch checkpoint; restore its files"
            )
        raise CheckpointError(f"{pointer}: names {path.name}, which has no {METADATA}")
    return path
