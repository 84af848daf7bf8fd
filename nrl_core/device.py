"""Device discipline, written once: where tensors must be for collectives, the model and offload.

Why one module: a collective on an NCCL group accepts only CUDA tensors and one on gloo wants CPU
tensors, the loss needs its batch fields on the logprobs' device, and a colocated engine only
gets device memory back after the offloaded tensors are freed *and* torch's cache is emptied.
Every collective in the training backends and the refit goes through the functions here
(``tests/core/test_device_discipline.py`` checks the source), so a GPU node differs from the CPU
in one place. Without CUDA every function reduces to what the code did before (gloo, CPU,
pageable memory, float32).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from nrl_core.errors import NrlError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "CHECK_DEVICES_ENV", "all_gather", "all_reduce", "all_reduce_values", "broadcast", "check_batch_device",
    "collective_device", "default_precision", "free_device_cache", "host_copy", "model_device", "move_optimizer_state",
    "move_tensors",
    "process_group_backend", "resolve_precision", "to_device", "to_host", "uses_nccl",
]

CHECK_DEVICES_ENV = "NRL_CHECK_DEVICES"
"""Set to 1 (the test suite does) to make the backends check, before every loss call, that each
batch tensor the loss reads is on the logprobs' device."""

_NATIVE_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
T = TypeVar("T")


# --------------------------------------------------------------------------- process groups


def process_group_backend(cuda: bool | None = None) -> str:
    """The backend string for a group that carries CPU and GPU tensors: ``cpu:gloo,cuda:nccl``
    with CUDA (object collectives and DCP stay on gloo, tensors on NCCL), ``gloo`` without."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def uses_nccl(backend_config: str) -> bool:
    """Whether a group created with ``backend_config`` (``nccl`` or ``cpu:gloo,cuda:nccl``) runs NCCL,
    so its ranks must pick their CUDA device before joining it."""
    return backend_config.strip().lower() == "nccl" or _backends(backend_config).get("cuda") == "nccl"


def model_device() -> torch.device:
    """The device this process's model lives on: its current CUDA device, else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _backends(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}`` (torch's backend config)."""
    out = {}
    for part in config.split(","):
        device, _, backend = part.strip().partition(":")
        if backend:
            out[device] = backend.lower()
    return out


def collective_device(backend_config: str, tensor_device: torch.device) -> torch.device:
    """Where a tensor on ``tensor_device`` must be for a collective on a group with
    ``backend_config`` (``torch.distributed.get_backend_config``): its own device when the group
    has that device's native backend (gloo for CPU, NCCL for CUDA), the CUDA device for an NCCL
    group, the CPU otherwise. Groups on other backends (MPI, UCC, ...) keep the tensor where it is."""
    import torch

    backends = _backends(backend_config)
    native = _NATIVE_BACKEND.get(tensor_device.type)
    if native is not None and backends.get(tensor_device.type) == native:
        return tensor_device
    if backends.get("cuda") == "nccl":
        return torch.device("cuda")  # the current device: the one NCCL's communicator uses
    if backends.get("cpu") == "gloo":
        return torch.device("cpu")
    return tensor_device


def _staged(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    import torch.distributed as dist

    target = collective_device(dist.get_backend_config(group), tensor.device)
    if target.type == tensor.device.type:
        return tensor
    return tensor.to(target).contiguous()


def all_reduce(tensor: torch.Tensor, op: Any = None, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.distributed.all_reduce`` in place on ``tensor``, wherever it lives; returns it."""
    import torch.distributed as dist

    work = _staged(tensor, group)
    dist.all_reduce(work, op=dist.ReduceOp.SUM if op is None else op, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_reduce_values(values: Sequence[float], op: Any = None,
                      group: dist.ProcessGroup | None = None) -> list[float]:
    """Reduce a few Python numbers over ``group`` in one collective (float64)."""
    import torch

    return all_reduce(torch.tensor(list(values), dtype=torch.float64), op, group).tolist()


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.distributed.broadcast`` in place on ``tensor`` (``src`` a global rank); returns it."""
    import torch.distributed as dist

    work = _staged(tensor, group)
    dist.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), in group-rank order, on ``tensor``'s device."""
    import torch
    import torch.distributed as dist

    work = _staged(tensor.contiguous(), group)
    parts = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, work, group=group)
    return parts if work.device == tensor.device else [p.to(tensor.device) for p in parts]


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``torch.distributed.all_gather_into_tensor``: every rank's ``shard``, in group-rank order,
    written into ``output`` (``shard`` may be a view of it); returns ``output``."""
    import torch.distributed as dist

    work, part = _staged(output, group), _staged(shard.contiguous(), group)
    dist.all_gather_into_tensor(work, part, group=group)
    if work is not output:
        output.copy_(work)
    return output


# --------------------------------------------------------------------------- batches


def to_device(value: T, device: torch.device | str) -> T:
    """``value`` with every tensor in it on ``device``: a tensor, or dataclasses (``TokenBatch``,
    micro-batches, Megatron's ``PackedSeqParams``), dicts, lists and tuples of them. The one place
    batches move to the model's device; host tensors are pinned first so the copy is asynchronous.
    Tensors already there are returned as they are (no copy)."""
    import torch

    device = torch.device(device)
    if isinstance(value, torch.Tensor):
        if value.device == device or (value.device.type == device.type and device.index is None):
            return value
        if _is_dtensor(value):  # DTensors have no sharding rule for pinning; they move whole
            return value.to(device)  # type: ignore[return-value]
        if device.type == "cuda" and value.device.type == "cpu":
            return value.pin_memory().to(device, non_blocking=True)  # type: ignore[return-value]
        return value.to(device)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)
                   if f.init and not isinstance(getattr(value, f.name), (int, float, str, bool, type(None)))}
        return dataclasses.replace(value, **changes)  # type: ignore[return-value]
    if isinstance(value, Mapping):
        return type(value)({k: to_device(v, device) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(to_device(v, device) for v in value))  # type: ignore[return-value]
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)  # type: ignore[return-value]
    return value


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _tensors(value: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, Mapping):
        return [t for k, v in value.items() for t in _tensors(v, f"{path}[{k!r}]")]
    return []


def check_batch_device(batch: Any, device: torch.device, where: str) -> None:
    """With ``NRL_CHECK_DEVICES=1``: raise in one line when a tensor of ``batch`` is on another
    device type than ``device`` (the logprobs'), the mistake that fails only on a GPU. Otherwise
    a no-op, so production pays nothing."""
    if os.environ.get(CHECK_DEVICES_ENV, "") in ("", "0"):
        return
    for path, tensor in _tensors(batch, "batch"):
        if tensor.device.type != device.type:
            raise NrlError(f"{where}: {path} is on {tensor.device} but the logprobs are on {device}; move the "
                           "batch with nrl_core.device.to_device before the loss")


# --------------------------------------------------------------------------- offload


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory (itself when it already is), pinned when CUDA is available so the
    copy back is asynchronous. DTensors move through their own ``.to`` (not pinned)."""
    if tensor.device.type == "cpu":
        return tensor
    return host_copy(tensor)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` that never shares its storage (pinned when CUDA is available)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor) or not torch.cuda.is_available():
        return tensor.detach().to("cpu", copy=True)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return out.copy_(tensor.detach(), non_blocking=True)


def move_optimizer_state(optimizer: Any, device: torch.device) -> None:
    """Move an optimizer's per-parameter state (``optimizer.state``: torch's dict, or the
    ``ProxyDict`` over its leaves that Megatron's chained optimizer exposes, which has ``items``
    but no ``values``) to ``device``: pinned host memory on the way out."""
    import torch

    for _, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type != device.type:
                state[key] = to_host(value) if device.type == "cpu" else to_device(value, device)


def move_tensors(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    """Move each tensor's ``.data`` to ``device`` in place (pinned host memory on the way out), so
    whatever holds the tensor itself (an optimizer's param groups and its state keys) keeps working."""
    for tensor in tensors:
        if tensor.device.type != device.type:
            tensor.data = to_host(tensor.data) if device.type == "cpu" else to_device(tensor.data, device)


def free_device_cache() -> None:
    """After an offload: wait for the asynchronous copies, then give torch's cached blocks back to
    the driver, without which a colocated engine cannot allocate the memory just freed."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def trim_host_heap() -> None:
    """Give the C heap's free pages back to the system. glibc keeps freed memory for reuse, in one
    arena per thread, so the buffers a checkpoint read frees would otherwise stay in the process
    (and add up over a load's reader threads) rather than return when the read is done."""
    trim = _glibc("malloc_trim")
    if trim is not None:  # another C library: nothing to trim this way
        trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
HOST_MAP_THRESHOLD = 4 << 20  # host allocations this large or larger get pages of their own


def map_large_host_allocations() -> None:
    """Have glibc give each large host allocation pages of its own, returned to the system when
    freed. By default glibc raises that threshold to the size of the first such buffer freed, so
    the layer-sized buffers a sharded step gathers, reduces and frees come from the heap instead,
    where the tensors kept between them fragment it and the freed space stays with the process:
    a data-parallel rank's peak then carries slack that no sharding removes. Pinning the threshold
    also keeps the dynamic one from ever rising again."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:  # another C library: its own allocator's policy applies
        mallopt(M_MMAP_THRESHOLD, HOST_MAP_THRESHOLD)


def _glibc(name: str) -> Any:
    """glibc's function ``name``, or None where the C library is another one."""
    import ctypes

    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- precision


def default_precision(device: torch.device | None = None) -> str:
    """``bfloat16`` where the device computes in it natively (CUDA with bf16 support), else ``float32``."""
    import torch

    device = device or model_device()
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bfloat16"
    return "float32"


def resolve_precision(value: str | None, device: torch.device | None = None) -> str:
    """``policy.precision`` as given, or :func:`default_precision` when the config leaves it unset (null)."""
    return default_precision(device) if value is None else str(value)
