"""How many bytes of each refit tensor one engine rank reads.

A refit hands every rank of an engine the whole of each tensor (on one node, views of the same
shared memory), and vLLM's weight loaders copy out only what the rank holds: its slice under
tensor parallelism, nothing of another rank's experts under expert parallelism. This counter
proves that per rank and per tensor: it watches the copies the loaders make while a refit loads
(``copy_``, ``_to_copy``, ``clone``; vLLM's loaders read through these) and attributes each one
whose source lies in a refit tensor to that tensor's name. Copies into ``meta`` tensors (vLLM's
layerwise reload dry-runs every loader on them) read nothing and are not counted. Off by default
(the extension's ``nrl_count_refit_reads``): it sees every tensor operation of the load.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

_READS = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default, torch.ops.aten.clone.default)


def _extent(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last, whatever its strides."""
    if tensor.numel() == 0:
        return 0
    return (sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1) \
        * tensor.element_size()


class RefitReadCounter(TorchDispatchMode):
    """Bytes read out of the tracked tensors by copies into real (not ``meta``) tensors, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read: dict[str, int] = defaultdict(int)
        # storage address -> (the storage, while it lives; sorted (start, end, name) spans in it)
        self._spans: dict[int, tuple[StorageWeakRef, list[tuple[int, int, str]]]] = {}

    def track(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the refit's tensors through, remembering where each one lies."""
        for name, tensor in named:
            storage = tensor.untyped_storage()
            entry = self._spans.get(storage.data_ptr())
            if entry is None or entry[0].expired():  # a freed bucket's address may be reused
                entry = self._spans[storage.data_ptr()] = (StorageWeakRef(storage), [])
            start = tensor.storage_offset() * tensor.element_size()
            bisect.insort(entry[1], (start, start + _extent(tensor), name))
            self.bytes_read.setdefault(name, 0)
            yield name, tensor

    def _source_name(self, tensor: Any) -> str | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        entry = self._spans.get(tensor.untyped_storage().data_ptr())
        if entry is None or entry[0].expired():
            return None
        spans = entry[1]
        offset = tensor.storage_offset() * tensor.element_size()
        i = bisect.bisect_right(spans, (offset, float("inf"), "")) - 1
        return spans[i][2] if i >= 0 and spans[i][0] <= offset < spans[i][1] else None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _READS:
            source, destination = (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            name = self._source_name(source) if destination.device.type != "meta" else None
            if name is not None:
                self.bytes_read[name] += source.numel() * source.element_size()
        return out
