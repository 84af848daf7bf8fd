"""How many bytes of each refit tensor one engine rank reads.

A rank's first refit hands it the whole of each tensor (on one node, views of the same shared
memory), and vLLM's weight loaders copy out only what the rank holds: its slice under tensor
parallelism, nothing of another rank's experts under expert parallelism. This counter
proves that per rank and per tensor: it watches the copies the loaders make while a refit loads
(``copy_``, ``_to_copy``, ``clone``; vLLM's loaders read through these) and attributes each one
whose source lies in a refit tensor to that tensor's name. Copies into ``meta`` tensors (vLLM's
layerwise reload dry-runs every loader on them) read nothing and are not counted.

The same watch learns each tensor's block (:attr:`RefitReadCounter.regions`): the box of indices
the rank's loaders read, which the rank then names in ``refit_wants`` (``sliced_import``) so that
later refits send it only that. A tensor read through anything but a copy of a plain slice of it
counts as read whole. Off by default (the extension's ``nrl_count_refit_reads`` and
``nrl_learn_refit_regions``): it sees every tensor operation of the load.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from nrl_core.api import is_owned_region

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
        self.regions: dict[str, list[list[int]] | None] = {}  # [start, stop] per dimension; None: whole
        self._roots: dict[str, tuple[int, tuple[int, ...], int, bool]] = {}  # offset, shape, element size, contiguous
        # storage address -> (the storage, while it lives; sorted (start, end, name) spans in it)
        self._spans: dict[int, tuple[StorageWeakRef, list[tuple[int, int, str]]]] = {}

    def track(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the refit's tensors through, remembering where each one lies."""
        for name, handed in named:
            tensor = handed.part if is_owned_region(handed) else handed  # a block: counted, its box known
            if tensor is None:
                yield name, handed
                continue
            storage = tensor.untyped_storage()
            entry = self._spans.get(storage.data_ptr())
            if entry is None or entry[0].expired():  # a freed bucket's address may be reused
                entry = self._spans[storage.data_ptr()] = (StorageWeakRef(storage), [])
            start = tensor.storage_offset() * tensor.element_size()
            bisect.insort(entry[1], (start, start + _extent(tensor), name))
            self.bytes_read.setdefault(name, 0)
            if tensor is handed:
                self._roots[name] = (tensor.storage_offset(), tuple(tensor.shape), tensor.element_size(),
                                     tensor.is_contiguous())
            del tensor, storage  # not kept while the next arrives (released.py)
            yield name, handed
            del handed

    def moved(self, storage_address: int, offset: int, tensor: torch.Tensor) -> None:
        """``tensor``, tracked at element ``offset`` of the storage at ``storage_address``, now has
        a storage of its own (:mod:`nrl_gen_vllm.released`): its reads are still its name's."""
        entry = self._spans.get(storage_address)
        start = offset * tensor.element_size()
        name = next((span[2] for span in entry[1] if span[0] == start), None) if entry else None
        if name is None:
            return
        storage = tensor.untyped_storage()
        self._spans[storage.data_ptr()] = (StorageWeakRef(storage), [(0, _extent(tensor), name)])
        if name in self._roots:
            _, shape, element_size, _ = self._roots[name]
            self._roots[name] = (0, shape, element_size, True)

    def _source_name(self, tensor: Any) -> str | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        try:
            entry = self._spans.get(tensor.untyped_storage().data_ptr())
        except RuntimeError:  # a tensor without storage of its own (a wrapper subclass)
            return None
        if entry is None or entry[0].expired():
            return None
        spans = entry[1]
        offset = tensor.storage_offset() * tensor.element_size()
        i = bisect.bisect_right(spans, (offset, float("inf"), "")) - 1
        return spans[i][2] if i >= 0 and spans[i][0] <= offset < spans[i][1] else None

    def _read(self, name: str, view: torch.Tensor) -> None:
        """Grow ``name``'s box to hold ``view``, or mark it whole when ``view`` is not a box of it."""
        if view.numel() == 0 or name not in self._roots or (name in self.regions and self.regions[name] is None):
            return
        box = _box(view, *self._roots[name])
        held = self.regions.get(name)
        if box is None or held is None:
            self.regions[name] = box
        else:
            self.regions[name] = [[min(a, c), max(b, d)] for (a, b), (c, d) in zip(held, box)]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _READS:
            source, destination = (args[1], args[0]) if func is torch.ops.aten.copy_.default else (args[0], out)
            name = self._source_name(source)
            if name is not None:
                self._read(name, source)
                if destination.device.type != "meta":
                    self.bytes_read[name] += source.numel() * source.element_size()
        elif not func.is_view:  # read some other way (arithmetic, a concatenation): the rank needs it whole
            for arg in (*args, *(kwargs or {}).values()):
                name = self._source_name(arg)
                if name is not None:
                    self.regions[name] = None
        return out


def _box(view: torch.Tensor, root_offset: int, root_shape: tuple[int, ...], element_size: int,
         contiguous: bool) -> list[list[int]] | None:
    """The ``[start, stop]`` per dimension of ``view`` inside a contiguous tensor of ``root_shape``
    starting at ``root_offset`` (elements of the same storage), or None when ``view`` is not a box
    of it in its own order (a transpose, a reshape, another dtype). A view with fewer dimensions
    (an index taken) spans one index of each dimension it dropped."""
    if not contiguous or view.element_size() != element_size:
        return None
    strides, step = [], 1
    for size in reversed(root_shape):
        strides.append(step)
        step *= size
    strides.reverse()
    rest = view.storage_offset() - root_offset
    if rest < 0:
        return None
    starts = []
    for stride in strides:
        start, rest = divmod(rest, stride)
        starts.append(start)
    extents = [1] * len(root_shape)
    last = -1
    for view_size, view_stride in zip(view.shape, view.stride()):
        if view_size == 1:
            continue
        dims = [d for d in range(last + 1, len(root_shape)) if strides[d] == view_stride and root_shape[d] > 1]
        if not dims:
            return None
        last = dims[0]
        extents[last] = view_size
    box = [[start, start + extent] for start, extent in zip(starts, extents)]
    return box if rest == 0 and all(stop <= size for (_, stop), size in zip(box, root_shape)) else None
