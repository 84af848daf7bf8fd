"""Reading a checkpoint without running code from it (:mod:`nrl_core.sdk.safe_dcp` holds the
reader every backend shares).

Everything the dtensor backend reads goes through here: ``.pt`` files with
``torch.load(weights_only=True)``, DCP's ``.metadata`` through the safe reader, and DCP's
non-tensor items (optimizer hyper-parameters) with ``weights_only=True`` instead of the default
planner's ``weights_only=False``. Anything else is refused with :class:`UnsafeCheckpointError`
naming the file.
"""

from __future__ import annotations

import io
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from nrl_core.api import SafeFileSystemReader, UnsafeCheckpointError, load_bytes_item, load_file

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "dcp_load", "load_file"]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``weights_only=True``."""

    def __init__(self, checkpoint_dir: str) -> None:
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self.refused: UnsafeCheckpointError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            load_bytes_item(self, read_item, value, self.checkpoint_dir)
        except UnsafeCheckpointError as exc:
            self.refused = exc
            raise


def dcp_load(state_dict: dict[str, Any], checkpoint_dir: str, *, no_dist: bool = False) -> None:
    """``dcp.load`` into ``state_dict`` through the safe reader and planner. A refusal is raised as
    itself (DCP would otherwise retry, then wrap it in an exception that names only the ranks)."""
    reader, planner = SafeFileSystemReader(checkpoint_dir), SafeLoadPlanner(checkpoint_dir)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, CheckpointException):
        refused = reader.refused or planner.refused
        if refused is not None:
            raise refused from None
        raise
