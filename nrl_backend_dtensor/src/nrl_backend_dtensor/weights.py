"""Weights out of a sharded model: HF-named full tensors in buckets (refit, and the HF export the
SDK builds from them).

Refit sends the tensors the model's checkpoint files hold (:func:`nrl_core.refit.hf_source.
checkpoint_layout`): for a mixture-of-experts model, one tensor per expert and projection rather
than transformers' fused in-memory ``gate_up_proj``/``down_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

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


def manifest(model: nn.Module, dtype: str,
             shapes: Iterable[tuple[str, torch.Size]] | None = None) -> list[WeightSpec]:
    """Every exported tensor's HF name and full (global) shape, in export order. Local: no
    collective. ``shapes``: the module names and shapes to export, when not the parameters'
    (LoRA's merged weights)."""
    _dtype(dtype)
    hf = _hf_model(model)
    named = shapes if shapes is not None else ((name, p.shape) for name, p in model.named_parameters())
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
        for name, full in (tensors if tensors is not None else parameters()):
            yield from checkpoint_layout(hf, {hf_name(name): full.detach().to(target)})

    return iter_buckets(named(), bucket_bytes)
