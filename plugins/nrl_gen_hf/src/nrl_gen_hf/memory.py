"""Colocated memory hand-off: the engine's weights leave the GPU while the policy trains.

Between generations a colocated engine parks its weights in host memory (pinned, so the way back
is a fast copy) and returns the freed blocks to the driver with ``torch.cuda.empty_cache()``:
without it torch's caching allocator keeps them and training cannot use them. On the CPU there is
nothing to move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _tensors(module: Any) -> list[torch.Tensor]:
    """Every parameter and buffer once (tied weights are one parameter)."""
    seen: set[int] = set()
    out = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


def park(module: Any) -> None:
    """Move ``module``'s weights from its GPU to pinned host memory and release the GPU blocks."""
    import torch

    for tensor in _tensors(module):
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            host.copy_(tensor.data)
            tensor.data = host
    torch.cuda.empty_cache()


def restore(module: Any, device: torch.device) -> None:
    """Move parked weights back to ``device``."""
    import torch

    for tensor in _tensors(module):
        if tensor.device != device:
            tensor.data = tensor.data.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
