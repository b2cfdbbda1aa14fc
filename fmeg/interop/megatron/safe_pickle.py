"""The two pickles of a Megatron torch_dist checkpoint, read without running anything they name.

    metadata = read_dcp_metadata(Path("ck/iter_0000100/.metadata"))   # PyTorch DCP's Metadata
    common = read_common(Path("ck/iter_0000100/common.pt"))          # {"args": Namespace, "iteration": 100, ...}

`.metadata` is a plain pickle of PyTorch distributed checkpoint's metadata dataclasses: it is read by an
unpickler that resolves only those classes (and torch.Size, the dtypes, a layout lookup); any other global is a
MegatronCheckpointError naming it. `common.pt` is a torch.save file: torch.load reads it with weights_only=True,
which admits tensors and plain containers; argparse.Namespace (Megatron's args) is admitted as well, and
megatron-core's enums in the args (AttnBackend and the like) become inert MegatronValue records: nothing of
Megatron is imported or called. Anything else a pickle names is refused before a byte of it is unpickled.
saved_tensor reads a chunk's own data.pkl as the layout of its tensor (storage record, dtype, offset, size,
stride), resolving only the rebuild function and the storage types to stand-ins, so that a rank reads only the
bytes of the rows it needs.
"""

from __future__ import annotations

import argparse
import io
import pickle
from pathlib import Path
from typing import Any, NamedTuple

import torch


class MegatronCheckpointError(ValueError):
    """A Megatron checkpoint this reader cannot take: one line naming the file and the fix."""


_DCP = "torch.distributed.checkpoint"
_DCP_CLASSES = {
    f"{_DCP}.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    f"{_DCP}.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"},
    "torch.serialization": {"_get_layout"},  # torch.strided from its name
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta's checkpoint_id, as DCP's FileSystemWriter writes it
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                      torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which a checkpoint's metadata never needs")


def read_dcp_metadata(path: Path) -> Any:
    """PyTorch DCP's Metadata from a `.metadata` file, or a MegatronCheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise MegatronCheckpointError(f"{path}: missing; a torch_dist checkpoint's index of its shards is "
                                      "written last, so this save did not finish: load an earlier iteration")
    except pickle.UnpicklingError as e:
        raise MegatronCheckpointError(f"{path}: refused, it {e}; nothing was run (a damaged or crafted file)")
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise MegatronCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e}); the file is damaged")
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise MegatronCheckpointError(f"{path}: not a PyTorch distributed checkpoint's metadata")
    return metadata


class MegatronValue:
    """An inert stand-in for a megatron-core class named in Megatron's args (an enum, mostly): its name and the
    arguments it was pickled with, for display only."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}{self.args!r}"


def _stand_in(qualified: str) -> type:
    return type(qualified.rsplit(".", 1)[-1], (MegatronValue,), {"__module__": "fmeg.interop.megatron.stand_in"})


def read_common(path: Path) -> dict:
    """common.pt's dict (args, iteration, checkpoint_version, ...), read with weights_only=True."""
    if not path.is_file():
        raise MegatronCheckpointError(f"{path}: missing; a Megatron torch_dist iteration holds its args and "
                                      "iteration there")
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # noqa: BLE001 - any failure to parse the archive is a damaged file
        raise MegatronCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e}); the file is damaged")
    allowed: list = []
    for name in names:
        if name == "argparse.Namespace":
            allowed.append(argparse.Namespace)
        elif name.startswith("megatron."):
            allowed.append((_stand_in(name), name))
        else:
            raise MegatronCheckpointError(f"{path}: refused, its pickle names {name}, which Megatron's common "
                                          "state never holds; nothing was run (a damaged or crafted file)")
    try:
        with torch.serialization.safe_globals(allowed):
            common = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's restricted loader refuses in many types
        raise MegatronCheckpointError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    if not isinstance(common, dict):
        raise MegatronCheckpointError(f"{path}: holds a {type(common).__name__}, not Megatron's common state dict")
    return common


_STORAGE_DTYPES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                   "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


class SavedTensor(NamedTuple):
    """Where one torch.save'd tensor's elements lie: its storage record, dtype, storage offset, size, stride."""
    storage: str
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _TensorUnpickler(pickle.Unpickler):
    """A torch.save archive's data.pkl of one tensor, read as its layout: the rebuild function and the storage
    types resolve to local stand-ins (nothing of torch is called); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: SavedTensor(*storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"names {module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype]:
        kind, dtype, key, _location, _numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"holds a persistent id {kind!r}")
        return str(key), dtype


def saved_tensor(data_pkl: bytes) -> SavedTensor:
    """The layout of the one tensor a torch.save archive's data.pkl describes; ValueError if it is not that."""
    try:
        found = _TensorUnpickler(io.BytesIO(data_pkl)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"not one tensor's layout ({e})") from None
    if not isinstance(found, SavedTensor):
        raise ValueError("not one tensor's layout")
    return found
