"""Megatron's distributed checkpoints read without running code from them.

Megatron-Core's ``torch_dist`` loader reads DCP's ``.metadata`` with plain ``pickle.load`` and its
sharded objects (RNG states and the like) with ``torch.load(weights_only=False)``, so a checkpoint
directory from someone else could run code on resume. :func:`safe_dist_checkpointing` points both
at :mod:`nrl_core.sdk.safe_dcp` (the readers the DTensor backend uses) for every load in this
process, and :func:`refusal` recovers the one-line refusal from the exception DCP wraps it in.
Megatron's ``common.pt`` is read by torch's default ``weights_only=True`` already.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

from nrl_core.api import SafeFileSystemReader, UnsafeCheckpointError, load_bytes_item

_installed = threading.Lock()
_done = False
_refusals: list[UnsafeCheckpointError] = []  # the last load's, for refusal()
_loading = ["the checkpoint"]  # the directory the current load reads, to name in a refusal


class _SafeCachedReader(SafeFileSystemReader):
    """The safe reader, caching the metadata as Megatron's own reader does (it reads it twice)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._cached: Any = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._cached is None:
            try:
                self._cached = super().read_metadata(*args, **kwargs)
            except UnsafeCheckpointError as exc:
                _refusals.append(exc)
                raise
        return self._cached


def safe_dist_checkpointing() -> None:
    """Route Megatron-Core's ``torch_dist`` loads in this process through the safe readers (once)."""
    global _done
    with _installed:
        if _done:
            return
        from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

        def reader(checkpoint_dir: str | Path, cache_metadata: bool = False) -> SafeFileSystemReader:
            return _SafeCachedReader(checkpoint_dir) if cache_metadata else SafeFileSystemReader(checkpoint_dir)

        def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
            try:
                load_bytes_item(self, read_item, value, _loading[0])
            except UnsafeCheckpointError as exc:
                _refusals.append(exc)
                raise

        mcore_torch._get_filesystem_reader = reader
        mcore_torch.MCoreLoadPlanner.load_bytes = load_bytes
        _done = True


def start_load(path: str | Path) -> None:
    """Called before each load of ``path``: forget earlier refusals."""
    _refusals.clear()
    _loading[0] = str(path)


def refusal() -> UnsafeCheckpointError | None:
    """The refusal behind the load that just failed, if a file was refused."""
    return _refusals[-1] if _refusals else None
