"""One received bucket in memory at a time, though vLLM keeps some of its tensors.

vLLM's layerwise reload keeps each tensor it is handed until the module it feeds has all of its
weights, and a view of a bucket keeps the bucket's whole buffer: a module whose weights straddle two
buckets held the first bucket's buffer while the second was received. Here each tensor is handed
as an alias of its bucket's storage (not a view, which would keep the buffer through its base);
once the engine has read the bucket, the aliases something still holds get a copy of their own,
so the buffer goes before the next bucket arrives. The copies are the straddling module's part,
which vLLM would stage anyway.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from nrl_core.api import is_owned_region
from nrl_gen_vllm.refit_reads import RefitReadCounter

Bucket = list[tuple[str, Any]]

_REFERENCES_OF_OURS = 3
"""References to a handed tensor that are this module's: the list of its buffer's tensors, the loop
variable and ``sys.getrefcount``'s argument."""


def released(buckets: Iterable[Bucket], files_end_with_the_bucket: bool = False) -> Iterator[Bucket]:
    """``buckets``, each as aliases of its storage; once the next bucket is asked for, the tensors
    still referenced get copies of their own where that frees the rest of their buffer. A buffer
    something else keeps (shared memory's receiver keeps its mapped files) is left as it is, and so
    is a mapped file, whose pages stay until the file is removed, unless
    ``files_end_with_the_bucket`` (the async engine's parts, each removed once loaded). What hands
    the buckets must keep none of them between its yields (the core's receivers do not)."""
    for bucket in buckets:
        handed = [(name, _alias(tensor)) for name, tensor in bucket]
        del bucket
        yield handed
        tensors = [tensor for _, tensor in handed]
        handed.clear()  # the consumer's stale reference to this list no longer holds the tensors
        _release(tensors, files_end_with_the_bucket)


def _release(tensors: list[Any], files_end_with_the_bucket: bool) -> None:
    groups = _by_storage(tensors)
    tensors.clear()
    for storage, group in groups.values():
        if torch._C._storage_Use_Count(storage._cdata) > len(group) + 1:
            continue  # something besides these tensors keeps the buffer: copying them frees nothing
        if storage.filename is not None and not files_end_with_the_bucket:
            continue  # the file keeps its pages until its owner removes it
        held = [tensor for tensor in group if sys.getrefcount(tensor) > _REFERENCES_OF_OURS]
        if held and sum(_nbytes(tensor) for tensor in held) < storage.nbytes():
            for tensor in held:
                _own_copy(tensor)


def _by_storage(tensors: list[Any]) -> dict[int, tuple[torch.UntypedStorage, list[Any]]]:
    """``tensors`` by the storage they lie in, built in a frame of its own: a loop variable left
    behind would count as a holder of the last tensor."""
    groups: dict[int, tuple[torch.UntypedStorage, list[Any]]] = {}
    for tensor in tensors:
        data = _data(tensor)
        if isinstance(data, torch.Tensor) and type(data) is torch.Tensor:
            storage = data.untyped_storage()
            groups.setdefault(storage.data_ptr(), (storage, []))[1].append(tensor)
    return groups


def _data(tensor: Any) -> Any:
    """The tensor that holds ``tensor``'s storage: an owned region's block, or itself."""
    return tensor.part if is_owned_region(tensor) else tensor


def _nbytes(tensor: Any) -> int:
    data = _data(tensor)
    return data.numel() * data.element_size()


def _alias(tensor: Any) -> Any:
    """The same tensor without a view's reference to its base; an owned region's block likewise."""
    if is_owned_region(tensor):
        if tensor.part is not None:
            tensor.part = _alias(tensor.part)
        return tensor
    if not isinstance(tensor, torch.Tensor) or type(tensor) is not torch.Tensor or tensor._base is None:
        return tensor
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _own_copy(tensor: Any) -> None:
    """Point ``tensor`` (or an owned region's block) at a copy of its data, in place, so every
    holder keeps the same values and the bucket's storage loses this reference."""
    tensor = _data(tensor)
    if not isinstance(tensor, torch.Tensor) or type(tensor) is not torch.Tensor:
        return
    address, offset = tensor.untyped_storage().data_ptr(), tensor.storage_offset()
    counting = isinstance(_get_current_dispatch_mode(), RefitReadCounter)  # the copy is no read of the loaders
    with _pop_mode_temporarily() if counting else contextlib.nullcontext() as counter, torch.no_grad():
        tensor.set_(tensor.clone())
    if counting:
        counter.moved(address, offset, tensor)
