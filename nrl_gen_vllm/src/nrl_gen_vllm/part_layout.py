"""How the async engine lays out one part of a refit in a flat byte buffer, on both sides.

The buffer is a ``/dev/shm`` file or a GPU buffer lent by CUDA IPC handle, and the layout crosses
vLLM's msgpack RPC, so it is plain values: one ``[name, dtype, shape, offset, nbytes]`` per tensor.
Each tensor starts on a 64-byte boundary: a view of bytes as a wider type needs an offset that
the type's size divides, which tensors of mixed dtypes packed end to end would not give. This
module imports no vLLM, so a check on a machine without it reads parts as the worker does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ALIGN = 64
Entry = list[Any]  # [name, dtype, shape, offset, nbytes]


def layout_of(part: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[Entry], int]:
    """Each tensor's entry in one flat buffer, and the buffer's size."""
    layout, offset = [], 0
    for name, tensor in part:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, nbytes])
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


def size_of(layout: Sequence[Entry]) -> int:
    """The bytes a buffer must hold for ``layout``: at least one, as a mapping needs."""
    return max(max((int(offset) + int(nbytes) for _, _, _, offset, nbytes in layout), default=0), 1)


def pack(data: torch.Tensor, part: Sequence[tuple[str, torch.Tensor]], layout: Sequence[Entry]) -> None:
    """Copy each tensor of ``part`` into its place in the flat ``uint8`` buffer ``data``."""
    for (_name, tensor), (_, _, _, start, nbytes) in zip(part, layout):
        data[start:start + nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))


def views(data: torch.Tensor, layout: Sequence[Entry]) -> list[tuple[str, torch.Tensor]]:
    """The part as views of ``data`` (no copy); an entry that does not describe a place in it is
    refused in one line."""
    out = []
    for name, dtype_name, shape, offset, nbytes in layout:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"refit part: {name!r} names dtype {dtype_name!r}, which is not a torch dtype")
        numel = 1
        for d in shape:
            numel *= int(d)
        if nbytes != numel * dtype.itemsize or offset % dtype.itemsize or offset + nbytes > data.numel():
            raise ValueError(f"refit part: {name!r} ({dtype_name} {list(shape)}) does not fit at byte {offset} "
                             f"of a {data.numel()}-byte buffer as {nbytes} bytes")
        out.append((name, data[offset:offset + nbytes].view(dtype).view(shape)))
    return out
