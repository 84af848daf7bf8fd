"""Weights out of a sharded model: HF-named full tensors in buckets (refit) and an HF export."""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from nrl_core.contracts import WeightSpec
from nrl_backend_dtensor.model import hf_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'{name}' is not a torch dtype name (float32, bfloat16, ...)")
    return dtype


def manifest(model: nn.Module, dtype: str) -> list[WeightSpec]:
    """Every parameter's HF name and full (global) shape, in export order. Local: no collective."""
    _dtype(dtype)
    return [WeightSpec(name=hf_name(n), shape=tuple(p.shape), dtype=dtype) for n, p in model.named_parameters()]


def export_buckets(model: nn.Module, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors cast to ``dtype`` in buckets of at most ``bucket_bytes`` (a larger tensor goes
    alone). Each DTensor is gathered with ``full_tensor()``, a collective: every rank iterates."""
    target = _dtype(dtype)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        tensor = full.detach().to(target)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_name(name), tensor))
        size += nbytes
    if bucket:
        yield bucket


def full_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded HF-named state dict on rank 0's CPU (empty elsewhere). Collective."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {hf_name(k): v for k, v in sd.items()}


def export_hf(model: nn.Module, hf_config: Any, tokenizer_dir: str, path: str) -> None:
    """Write ``save_pretrained`` safetensors of an unsharded copy plus the tokenizer files, from
    rank 0. Collective (every rank gathers); returns after rank 0 has finished writing."""
    from transformers import AutoModelForCausalLM

    state = full_hf_state_dict(model)
    if dist.get_rank() == 0:
        with torch.device("meta"):
            copy = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        copy.load_state_dict(state, strict=False, assign=True)
        copy.tie_weights()
        os.makedirs(path, exist_ok=True)
        copy.save_pretrained(path, safe_serialization=True)
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(path, name))
    dist.barrier()
