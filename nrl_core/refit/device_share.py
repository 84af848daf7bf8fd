"""A GPU buffer lent to another process on the same GPU, by CUDA IPC handle instead of through host memory.

Where two processes share a GPU (vLLM's async engine runs its model in a child process beside the
process that receives the refit), the weights can stay on the device: the owner packs a part
into one flat buffer and hands the child the buffer's IPC handle, which the child opens as a tensor
of its own without a copy. Through ``/dev/shm`` the same part costs a device-to-host copy and a
host-to-device one, at pageable host memory's speed.

The handle is a list of plain values (bytes, ints, a bool), so any RPC can carry it, vLLM's
msgpack among them. PyTorch keeps the owner's memory until the opener's storage is gone (its IPC
reference counter), so freeing the buffer early cannot pull it from under a reader; the owner
calls :func:`collect_lent_buffers` to return what readers have let go.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["collect_lent_buffers", "lend_device_buffer", "open_lent_buffer"]


def lend_device_buffer(flat: torch.Tensor) -> list[Any]:
    """The handle of ``flat``, a contiguous ``uint8`` CUDA tensor, for a process on the same GPU:
    ``[device, handle, storage bytes, storage offset, ref-counter handle, ref-counter offset,
    event handle, event sync required, tensor byte offset, tensor bytes]``. The caller keeps
    ``flat`` until the reader has loaded it."""
    import torch

    if flat.device.type != "cuda" or flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"a lent buffer is a flat contiguous uint8 CUDA tensor, got {flat.dtype} {tuple(flat.shape)} "
                         f"on {flat.device}")
    fields = flat.untyped_storage()._share_cuda_()
    return [*fields, int(flat.storage_offset()), int(flat.numel())]


def open_lent_buffer(handle: Sequence[Any]) -> torch.Tensor:
    """The flat ``uint8`` tensor a handle of :func:`lend_device_buffer` names, opened in this
    process (a different one from the lender's: CUDA opens no handle in the process that made it)."""
    import torch

    if len(handle) != 10:
        raise ValueError(f"a lent buffer's handle has 10 fields, got {len(handle)}")
    *fields, offset, nbytes = handle
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(*fields)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, int(offset), (int(nbytes),))


def collect_lent_buffers() -> None:
    """Free the lent buffers whose readers have closed them (PyTorch defers their release until
    then); a no-op without CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()
