"""The model built without memory, then each rank reads only its own part of the checkpoint.

Why: loading the whole HF model on every rank before FSDP shards it costs every rank the full
model (a 70B model is 280 GB in float32), so memory per rank would not fall as ranks grow. Here
the parameters are created on the meta device, tensor parallelism and FSDP lay them out, and
each rank then materialises its local shards and fills them from the safetensors files, reading
only the slice of each tensor it owns (a layout whose local part is not one slice, FSDP over
tensor-parallel rows, reads one whole tensor at a time and keeps its part). Buffers are kept as
built (rotary tables, absent from checkpoints), and a persistent buffer the checkpoint holds takes
its value from it.

What still loads whole (``from_pretrained``, then sharded): a value head or LoRA (fresh weights
to initialise), a quantized checkpoint, and a model whose checkpoint layout differs from its
parameters (fused MoE experts); :func:`why_not_sharded` names the reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nrl_core.api import NrlError


@dataclass
class LoadStats:
    """What this rank's load read and holds, in bytes (the tests' measure of "only its share")."""

    path: str  # "sharded" or "whole: <reason>"
    bytes_read: int = 0  # tensor bytes the sharded reader read (0 when the model loaded whole)
    local_bytes: int = 0  # bytes of this rank's local parameters
    largest_read: int = 0  # the largest single read


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside live on the meta device (no memory); buffers stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def checkpoint_index(model_dir: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it."""
    directory = Path(model_dir)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {name: str(directory / file) for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, str] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update(dict.fromkeys(handle.keys(), str(file)))
    return out


def why_not_sharded(model: nn.Module, index: dict[str, str]) -> str | None:
    """None when every parameter of the meta-built ``model`` is a tensor of the checkpoint under
    its own name, else the reason to load the model whole."""
    from transformers.core_model_loading import revert_weight_conversion

    if getattr(model.config, "quantization_config", None):
        return "a quantized checkpoint loads through its quantizer"
    meta = {k: v for k, v in model.state_dict().items()}
    if revert_weight_conversion(model, dict(meta)).keys() != meta.keys():
        return "its checkpoint stores some weights in another layout than its parameters (fused experts)"
    missing = [name for name, _ in model.named_parameters() if name not in index]
    if missing:
        return f"the checkpoint names its weights differently ({missing[0]} is not in it)"
    return None


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Each parameter name that is another parameter (tied embeddings) to the name it is first
    found under, which is the one a checkpoint holds."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
    return ties


def _own_slice(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The region of the global tensor this rank's local part is, when it is one slice."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    if any(type(p) not in (Shard, Replicate) for p in param.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def load_own_shards(model: nn.Module, model_dir: str, index: dict[str, str], device: torch.device) -> LoadStats:
    """Materialise ``model``'s parameters (laid out by TP/FSDP on the meta device) on ``device``
    and fill each rank's local part from the checkpoint."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    # the buffers as built (and where FSDP put them): to_empty would leave them uninitialised
    buffers = [(module, name, b) for module in model.modules() for name, b in module._buffers.items() if b is not None]
    ties = tied_parameters(model)
    model.to_empty(device=device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    for name, source in ties.items():  # to_empty gives each module its own tensor: tie them again
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))
    stats = LoadStats(path="sharded")
    handles: dict[str, Any] = {}

    def handle(name: str) -> Any:
        file = index[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="pt").__enter__()
        return handles[file]

    try:
        with torch.no_grad():
            for name, buffer in model.named_buffers():  # a persistent buffer the checkpoint holds: its value
                if name in index:
                    buffer.copy_(handle(name).get_tensor(name).to(buffer.dtype))
            for name, param in model.named_parameters():
                file = index[name]
                local = param.to_local() if isinstance(param, DTensor) else param
                region = _own_slice(param)
                if region is not None and any(r.stop == r.start for r in region):
                    part, read = torch.empty(local.shape, dtype=local.dtype), 0  # an empty shard reads nothing
                elif region is not None:
                    part = handle(name).get_slice(name)[region]
                    read = part.numel() * part.element_size()
                else:  # not one slice: the whole tensor in flight, this rank keeps its part
                    whole = handle(name).get_tensor(name)
                    read = whole.numel() * whole.element_size()
                    part = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
                if tuple(part.shape) != tuple(local.shape):
                    raise NrlError(f"policy.model_name: {name} in {file} has the wrong shape for this model "
                                   f"(rank part {tuple(part.shape)}, expected {tuple(local.shape)})")
                local.copy_(part.to(local.dtype))
                stats.bytes_read += read
                stats.largest_read = max(stats.largest_read, read)
                stats.local_bytes += local.numel() * local.element_size()
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return stats
