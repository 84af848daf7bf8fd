"""Weights out of a sharded model: HF-named full tensors in buckets (refit, and the HF export the
SDK builds from them).

Refit sends the tensors the model's checkpoint files hold (:func:`nrl_core.refit.hf_source.
checkpoint_layout`): for a mixture-of-experts model, one tensor per expert and projection rather
than transformers' fused in-memory ``gate_up_proj``/``down_proj``. A persistent buffer is in
the checkpoint too (Gemma 4's per-layer ``layer_scalar``), so it travels after the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nrl_backend_dtensor.model import hf_name
from nrl_core.api import WeightSpec, checkpoint_layout, iter_buckets


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'{name}' is not a torch dtype name (float32, bfloat16, ...)")
    return dtype


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter: a collective for a DTensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _hf_model(model: nn.Module) -> nn.Module:
    return getattr(model, "hf", model)


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` saves (not rotary tables and other derived ones), by module name."""
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def buffer_names(model: nn.Module) -> set[str]:
    """The checkpoint names of :func:`persistent_buffers` (what :func:`manifest` lists them as)."""
    hf = _hf_model(model)
    return {n for name, buffer in persistent_buffers(model)
            for n, _ in checkpoint_layout(hf, {hf_name(name): torch.empty(buffer.shape, device="meta")})}


def manifest(model: nn.Module, dtype: str,
             shapes: Iterable[tuple[str, torch.Size]] | None = None) -> list[WeightSpec]:
    """Every exported tensor's HF name and full (global) shape, in export order. Local: no
    collective. ``shapes``: the module names and shapes to export, when not the parameters'
    (LoRA's merged weights)."""
    _dtype(dtype)
    hf = _hf_model(model)
    named = shapes if shapes is not None else ((name, p.shape) for name, p in model.named_parameters())
    named = [*named, *((name, b.shape) for name, b in persistent_buffers(model))]
    return [WeightSpec(name=n, shape=tuple(t.shape), dtype=dtype) for name, shape in named
            for n, t in checkpoint_layout(hf, {hf_name(name): torch.empty(shape, device="meta")})]


def export_buckets(model: nn.Module, bucket_bytes: int, dtype: str,
                   tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors cast to ``dtype`` in buckets of at most ``bucket_bytes`` (a larger tensor goes
    alone). Each DTensor is gathered with ``full_tensor()``, a collective: every rank iterates.
    ``tensors``: full tensors by module name to export instead of the parameters (LoRA's merged
    weights)."""
    target = _dtype(dtype)
    hf = _hf_model(model)

    def parameters() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            yield name, full_tensor(param)

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in chain(tensors if tensors is not None else parameters(), persistent_buffers(model)):
            yield from checkpoint_layout(hf, {hf_name(name): full.detach().to(target)})

    return iter_buckets(named(), bucket_bytes)
