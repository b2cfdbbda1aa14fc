"""safetensors files written as a stream and read a tensor at a time by offset, with a checksum per
tensor.

    crcs = write(path, [("params/x[0:4,0:8]", t), ...])     # fsynced; {key: crc32}
    with SafetensorsFile(path) as f:
        raw = f.read("params/x[0:4,0:8]")                   # that tensor's bytes only (one pread)

The format is safetensors' own (an 8-byte little-endian header length, a JSON header of dtypes,
shapes and byte ranges, then the data), so any safetensors reader opens these files. Writing streams
each tensor from its memory (no serialised copy of the file); reading takes exactly the bytes of the
tensors asked for, with pread, never the whole file and never a pickle.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
BY_NAME = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 1 << 30


class FileProblem(ValueError):
    """A file that cannot be read as asked; the message names the file (and the tensor)."""


def as_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy when it is contiguous."""
    t = t.detach().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def write(
    path: str | os.PathLike,
    tensors: list[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> dict[str, int]:
    """Write tensors (host memory, in this order) as a safetensors file and fsync it; returns {key:
    crc32 of the tensor's bytes}."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for key, t in tensors:
        size = t.numel() * t.element_size()
        header[key] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    crcs = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, t in tensors:
            data = as_bytes(t)
            crcs[key] = zlib.crc32(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return crcs


class SafetensorsFile:
    """One file opened for reads by tensor; bytes_read counts the data read (headers included)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileProblem(f"{self.path}: missing (the checkpoint lists it)") from None
        except OSError as e:
            raise FileProblem(f"{self.path}: unreadable ({e.strerror})") from None
        self.bytes_read = 0
        size = os.fstat(self.fd).st_size
        (length,) = struct.unpack("<Q", self._pread(8, 0, "its header")) if size >= 8 else (None,)
        if length is None or length > min(size - 8, MAX_HEADER):
            self.close()
            raise FileProblem(
                f"{self.path}: not a safetensors file (truncated or a bad header); the file is "
                "corrupt"
            )
        try:
            self.header = json.loads(self._pread(length, 8, "its header"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            self.header = None
        if not isinstance(self.header, dict):
            self.close()
            raise FileProblem(f"{self.path}: its header is not a JSON object; the file is corrupt")
        self.data_start, self.size = 8 + length, size

    def _pread(self, n: int, offset: int, what: str) -> bytes:
        data = os.pread(self.fd, n, offset)
        self.bytes_read += len(data)
        if len(data) != n:
            raise FileProblem(f"{self.path}: {what} is cut short (the file is truncated)")
        return data

    def read(
        self, key: str, crc: int | None = None, start: int = 0, count: int | None = None
    ) -> tuple[torch.Tensor, torch.dtype, list[int]]:
        """(the bytes of elements [start, start + count) of a tensor (default: all) as uint8, its
        dtype, its shape); a whole tensor read is checked against crc when given."""
        info = self.header.get(key)
        if not isinstance(info, dict) or info.get("dtype") not in BY_NAME:
            raise FileProblem(
                f"{self.path}: holds no tensor {key} (the file is not the one the checkpoint lists)"
            )
        dtype, shape = BY_NAME[info["dtype"]], info.get("shape")
        itemsize = torch.empty((), dtype=dtype).element_size()
        begin, end = info.get("data_offsets", (0, -1))
        numel = math.prod(shape) if isinstance(shape, list) else -1
        count = numel - start if count is None else count
        if (
            end - begin != numel * itemsize
            or self.data_start + end > self.size
            or start + count > numel
        ):
            raise FileProblem(
                f"{self.path}: tensor {key}: its header is inconsistent or the file is truncated; "
                "the file is corrupt"
            )
        size = count * itemsize
        out = torch.empty(size, dtype=torch.uint8)
        got = (
            os.preadv(self.fd, [out.numpy()], self.data_start + begin + start * itemsize)
            if size
            else 0
        )
        self.bytes_read += got
        if got != size:
            raise FileProblem(f"{self.path}: tensor {key} is cut short (the file is truncated)")
        if crc is not None and zlib.crc32(out.numpy()) != crc:
            raise FileProblem(f"{self.path}: tensor {key}: checksum mismatch; the file is corrupt")
        return out, dtype, shape

    def check_sha256(self, expected: str) -> None:
        """Check the whole file against a sha256 (older fmeg checkpoints, which have no per-tensor
        crc32)."""
        h, offset = hashlib.sha256(), 0
        while block := os.pread(self.fd, 1 << 22, offset):
            h.update(block)
            offset += len(block)
        self.bytes_read += offset
        if h.hexdigest() != expected:
            raise FileProblem(f"{self.path}: checksum mismatch; the file is corrupt")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
