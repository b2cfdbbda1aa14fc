"""The two pickles of a Megatron torch_dist checkpoint, read without running anything they name.

    metadata = read_dcp_metadata(Path("ck/iter_0000100/.metadata"))   # PyTorch DCP's Metadata
    # {"args": Namespace, "iteration": 100, ...}
    common = read_common(Path("ck/iter_0000100/common.pt"))

`.metadata` is a plain pickle of PyTorch distributed checkpoint's metadata dataclasses: it is read
by an unpickler that resolves only those classes (and torch.Size, the dtypes, a layout lookup); any
other global is a MegatronCheckpointError naming it. `common.pt` is a torch.save archive: its
data.pkl is read by an unpickler that turns every class it names into an inert MegatronValue
stand-in (Megatron-LM's args hold signal.Signals, megatron-core's enums, dataclasses of its configs;
a crafted file may name anything): nothing a pickle names is imported, constructed or called. Only
torch's dtypes are looked up by name, and tensors are rebuilt by fmeg from the archive's storage
records. saved_tensor reads a chunk's own data.pkl as the layout of its tensor (storage record,
dtype, offset, size, stride), resolving only the rebuild function and the storage types to
stand-ins, so that a rank reads only the bytes of the rows it needs.
"""

from __future__ import annotations

import argparse
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

import torch


class MegatronCheckpointError(ValueError):
    """A Megatron checkpoint this reader cannot take: one line naming the file and the fix."""


_DCP = "torch.distributed.checkpoint"
_DCP_CLASSES = {
    f"{_DCP}.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    f"{_DCP}.filesystem": {"_StorageInfo"},
    f"{_DCP}.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
    },
    # torch.strided from its name
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    # StorageMeta's checkpoint_id, as DCP's FileSystemWriter writes it
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"names {module}.{name}, which a checkpoint's metadata never needs"
        )


def read_dcp_metadata(path: Path) -> Any:
    """PyTorch DCP's Metadata from a `.metadata` file, or a MegatronCheckpointError naming the
    file."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise MegatronCheckpointError(
            f"{path}: missing; a torch_dist checkpoint's index of its shards is written last, so "
            "this save did not finish: load an earlier iteration"
        )
    except pickle.UnpicklingError as e:
        raise MegatronCheckpointError(
            f"{path}: refused, it {e}; nothing was run (a damaged or crafted file)"
        )
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise MegatronCheckpointError(
            f"{path}: unreadable ({type(e).__name__}: {e}); the file is damaged"
        )
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise MegatronCheckpointError(f"{path}: not a PyTorch distributed checkpoint's metadata")
    return metadata


class MegatronValue:
    """An inert stand-in for a global that common.pt's pickle names: built from what the pickle
    gives it and nothing else (no code of the class it stands for runs). `qualified` is the name it
    stands for."""

    qualified = ""

    # __new__ rather than __init__: a pickle's NEWOBJ calls only __new__, its REDUCE calls the class
    def __new__(cls, *args: Any, **kwargs: Any) -> "MegatronValue":
        self = super().__new__(cls)
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, {}
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for value in values:
            self.append(value)

    def __repr__(self) -> str:
        return f"{self.qualified}{self.args!r}"


def _stand_in(module: str, name: str) -> type:
    return type(
        name.rsplit(".", 1)[-1],
        (MegatronValue,),
        {"qualified": f"{module}.{name}", "__module__": "fmeg.interop.megatron.stand_in"},
    )


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    # protocol 2's form of bytes: _codecs.encode(str, "latin1"); any other codec is refused
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError("names _codecs.encode with another codec")
    return text.encode("latin1")


class _CommonUnpickler(pickle.Unpickler):
    """common.pt's data.pkl: every global becomes an inert stand-in, except the torch dtypes (values
    looked up by name), bytes' latin-1 form, and the tensor rebuild, which reads the archive's own
    storage record."""

    def __init__(self, file: io.BytesIO, storage: Any) -> None:
        super().__init__(file)
        self.storage = storage

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        if (module, name) == ("collections", "OrderedDict"):
            return _AttributedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt_tensor
        return _stand_in(module, name)

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"holds a persistent id {kind!r}")
        return self.storage(str(key), dtype, int(numel))


class _AttributedDict(dict):
    """OrderedDict's stand-in: a dict that also takes the attributes a pickle sets on it (a module
    state dict's _metadata, in --ckpt-format torch files)."""


def _rebuilt_tensor(
    storage: torch.Tensor, offset: int, size: Any, stride: Any, *_: Any
) -> torch.Tensor:
    try:
        return storage.as_strided(tuple(size), tuple(stride), int(offset)).clone()
    except RuntimeError as e:
        raise pickle.UnpicklingError(f"holds a tensor outside its storage ({e})") from None


def _archive_reader(archive: zipfile.ZipFile) -> tuple[bytes, Any]:
    """data.pkl's bytes and a function from (storage key, dtype, numel) to that storage's
    elements."""
    names = archive.namelist()
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise ValueError("no torch.save archive (no data.pkl)")
    prefix = pkl[0][: -len("data.pkl")]
    if f"{prefix}byteorder" in names and archive.read(f"{prefix}byteorder") != b"little":
        raise ValueError("a big-endian archive")

    def storage(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        data = archive.read(f"{prefix}data/{key}")
        if len(data) != numel * dtype.itemsize:
            raise pickle.UnpicklingError(
                f"storage {key} holds {len(data)} bytes, not {numel} {dtype}"
            )
        return (
            torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        )

    return archive.read(pkl[0]), storage


def _namespace(value: Any) -> Any:
    """argparse.Namespace's stand-in as a Namespace of its fields (values stay as read)."""
    if (
        isinstance(value, MegatronValue)
        and value.qualified == "argparse.Namespace"
        and isinstance(value.state, dict)
        and all(isinstance(k, str) for k in value.state)
    ):
        return argparse.Namespace(**value.state)
    return value


def read_common(path: Path) -> dict:
    """common.pt's dict (args, iteration, checkpoint_version, ...). Every class its pickle names is
    an inert MegatronValue (Megatron-LM's args hold signal.Signals, megatron-core's enums and more);
    the args Namespace comes back as an argparse.Namespace of what was pickled, tensors as tensors
    read from the archive."""
    if not path.is_file():
        raise MegatronCheckpointError(
            f"{path}: missing; a Megatron torch_dist iteration holds its args and iteration there"
        )
    common = _unpickled(path, path)
    if not isinstance(common, dict):
        raise MegatronCheckpointError(
            f"{path}: holds a {type(common).__name__}, not Megatron's common state dict"
        )
    common = {key: _namespace(value) for key, value in common.items()}
    args = common.get("args")
    if args is not None and not isinstance(args, argparse.Namespace):
        raise MegatronCheckpointError(
            f"{path}: its args are {args!r:.80}, not Megatron's argument Namespace; nothing was "
            "run (a damaged or crafted file)"
        )
    return common


def read_object(raw: bytes, where: str) -> Any:
    """A torch.save'd object in a distributed checkpoint (Megatron's ShardedObject: its distributed
    optimizer's param groups, its buckets' sizes), read as common.pt is: every class inert, and one
    naming any is refused (plain_state)."""
    return plain_state(_unpickled(io.BytesIO(raw), where), where)


def plain_state(value: Any, where: Any) -> Any:
    """value, when it holds only what an optimizer's saved state holds (numbers, strings, lists,
    dicts, tensors, dtypes); a MegatronCheckpointError naming `where` when its pickle named a
    class or function (an inert stand-in here): unpickled by torch, that would have run code."""
    name = _named_global(value)
    if name is not None:
        raise MegatronCheckpointError(
            f"{where}: refused, it holds a pickle that would run code ({name}), which fmeg refuses "
            "to run; nothing was run (a damaged or crafted file, not Megatron's optimizer state)"
        )
    return value


def _named_global(value: Any) -> str | None:
    """The name of the first global a read object holds (a MegatronValue), or None; each container
    is looked at once (a pickle may make one hold itself)."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, MegatronValue):
            return item.qualified
        if isinstance(item, (dict, list, tuple, set, frozenset)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
    return None


def _unpickled(source: Any, where: Any) -> Any:
    """The object a torch.save archive (a path or a file object) holds, through the inert
    unpickler; a MegatronCheckpointError naming `where` when it does not load."""
    try:
        with zipfile.ZipFile(source) as archive:
            data, storage = _archive_reader(archive)
            return _CommonUnpickler(io.BytesIO(data), storage).load()
    except pickle.UnpicklingError as e:
        raise MegatronCheckpointError(
            f"{where}: refused, it {e}; nothing was run (a damaged or crafted file)"
        )
    except (
        OSError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        RuntimeError,
        zipfile.BadZipFile,
        RecursionError,
        MemoryError,
    ) as e:
        raise MegatronCheckpointError(
            f"{where}: unreadable ({type(e).__name__}: {str(e)[:200]}); the file is damaged"
        )


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32,
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "DoubleStorage": torch.float64,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class SavedTensor(NamedTuple):
    """Where one torch.save'd tensor's elements lie: its storage record, dtype, storage offset,
    size, stride."""

    storage: str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorUnpickler(pickle.Unpickler):
    """A torch.save archive's data.pkl of one tensor, read as its layout: the rebuild function and
    the storage types resolve to local stand-ins (nothing of torch is called); anything else is
    refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: SavedTensor(
                *storage, offset, tuple(size), tuple(stride)
            )
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return _AttributedDict
        raise pickle.UnpicklingError(f"names {module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype]:
        kind, dtype, key, _location, _numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"holds a persistent id {kind!r}")
        return str(key), dtype


def saved_tensor(data_pkl: bytes) -> SavedTensor:
    """The layout of the one tensor a torch.save archive's data.pkl describes; ValueError if it is
    not that."""
    try:
        found = _TensorUnpickler(io.BytesIO(data_pkl)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"not one tensor's layout ({e})") from None
    if not isinstance(found, SavedTensor):
        raise ValueError("not one tensor's layout")
    return found
