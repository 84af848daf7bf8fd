"""Reading a distributed checkpoint without running code from it, for every backend.

``torch.load(weights_only=False)`` and ``pickle.load`` execute whatever a file asks for, so a
checkpoint directory from someone else could run code on resume. torch's distributed checkpoint
(DCP, which Megatron's ``torch_dist`` format is built on) reads two things that way:

* its ``.metadata`` file, with plain ``pickle.load``: :class:`SafeFileSystemReader` unpickles it
  resolving only DCP's own metadata and save-plan classes, ``torch.Size``, dtypes and layouts;
* its non-tensor items (optimizer hyper-parameters, RNG states, Megatron's sharded objects), with
  ``torch.load(weights_only=False)``: :func:`load_bytes_item` reads them with ``weights_only=True``.

Anything else is refused with :class:`UnsafeCheckpointError` naming the file, before it runs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from nrl_core.errors import NrlError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    # the save plans Megatron keeps in its metadata (plain dataclasses and enums)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(NrlError):
    """A checkpoint file would need arbitrary code to load."""


def unsafe_file(path: str, detail: str) -> UnsafeCheckpointError:
    """The one-line refusal of checkpoint file ``path``."""
    return UnsafeCheckpointError(f"checkpoint file '{path}' cannot be loaded safely ({detail}); nrl loads "
                                 f"checkpoints without running code from them: re-save it with nrl or load it "
                                 f"yourself if you trust its source")


def load_file(path: str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``; a file that needs more is refused, naming it."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or ["refused by weights_only"])[0]
        raise unsafe_file(path, first[:200]) from None


def load_bytes_item(planner: Any, read_item: Any, value: io.BytesIO, checkpoint_dir: str) -> None:
    """What a ``DefaultLoadPlanner.load_bytes`` does, with ``weights_only=True``: the non-tensor
    item read into the planner's state dict, or refused naming the directory and the entry."""
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or ["refused"])[0]
        raise unsafe_file(checkpoint_dir, f"entry '{fqn}': {first[:160]}") from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any, path: str) -> None:
        super().__init__(handle)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise unsafe_file(self.path, f"it references {module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a ``.metadata`` unpickler that resolves only DCP's metadata types.
    A refusal is kept (``refused``): DCP retries and wraps errors in exceptions naming only ranks."""

    refused: UnsafeCheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.refused is not None:  # DCP retries with rank-local metadata: the refusal stands
            raise self.refused
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            try:
                metadata = _MetadataUnpickler(handle, str(path)).load()
            except UnsafeCheckpointError as exc:
                self.refused = exc
                raise
        if not isinstance(metadata, Metadata):
            self.refused = unsafe_file(str(path), f"it holds a {type(metadata).__name__}, not DCP metadata")
            raise self.refused
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
