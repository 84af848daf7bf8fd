"""Reading a checkpoint without running code from it.

``torch.load(weights_only=False)`` and ``pickle.load`` execute whatever a file asks for, so a
checkpoint directory from someone else could run code on resume. Everything the dtensor backend
reads goes through here instead:

* ``.pt`` files: ``torch.load(weights_only=True)`` (tensors, containers and plain values only);
* DCP's ``.metadata`` (a pickle torch reads with plain ``pickle.load``): an unpickler that only
  resolves DCP's own metadata classes, ``torch.Size``, dtypes and layouts;
* DCP's non-tensor items (optimizer hyper-parameters): ``torch.load(weights_only=True)`` instead
  of the default planner's ``weights_only=False``.

Anything else is refused with :class:`UnsafeCheckpointError` naming the file.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from nrl_core.errors import NrlError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(NrlError):
    """A checkpoint file would need arbitrary code to load."""


def _refusal(path: str, detail: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint file '{path}' cannot be loaded safely ({detail}); nrl loads "
                                 f"checkpoints without running code from them: re-save it with nrl or load it "
                                 f"yourself if you trust its source")


def load_file(path: str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs more is refused, naming it."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or ["refused by weights_only"])[0]
        raise _refusal(path, first[:200]) from None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any, path: str) -> None:
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refusal(self.path, f"it references {module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a ``.metadata`` unpickler that resolves only DCP's metadata types."""

    _refused: UnsafeCheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._refused is not None:  # DCP retries with rank-local metadata: the refusal stands
            raise self._refused
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            try:
                metadata = _MetadataUnpickler(handle, str(path)).load()
            except UnsafeCheckpointError as exc:
                self._refused = exc
                raise
        if not isinstance(metadata, Metadata):
            raise _refusal(str(path), f"it holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``weights_only=True``."""

    def __init__(self, checkpoint_dir: str) -> None:
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self.refused: UnsafeCheckpointError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = (str(exc).strip().splitlines() or ["refused"])[0]
            self.refused = _refusal(self.checkpoint_dir, f"entry '{fqn}': {first[:160]}")
            raise self.refused from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state_dict: dict[str, Any], checkpoint_dir: str, *, no_dist: bool = False) -> None:
    """``dcp.load`` into ``state_dict`` through the safe reader and planner. A refusal is raised as
    itself (DCP would otherwise retry, then wrap it in an exception that names only the ranks)."""
    reader, planner = SafeFileSystemReader(checkpoint_dir), SafeLoadPlanner(checkpoint_dir)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, CheckpointException):
        refused = reader._refused or planner.refused
        if refused is not None:
            raise refused from None
        raise
