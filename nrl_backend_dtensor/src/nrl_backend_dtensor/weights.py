"""Weights out of a sharded model: HF-named full tensors in buckets (refit) and an HF export.

Refit sends the tensors the model's checkpoint files hold (:func:`nrl_core.refit.hf_source.
checkpoint_layout`): for a mixture-of-experts model, one tensor per expert and projection rather
than transformers' fused in-memory ``gate_up_proj``/``down_proj``.
"""

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
from nrl_core.refit.buckets import iter_buckets
from nrl_core.refit.hf_source import checkpoint_layout
from nrl_backend_dtensor.model import hf_name

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'{name}' is not a torch dtype name (float32, bfloat16, ...)")
    return dtype


def _hf_model(model: nn.Module) -> nn.Module:
    return getattr(model, "hf", model)


def manifest(model: nn.Module, dtype: str) -> list[WeightSpec]:
    """Every exported tensor's HF name and full (global) shape, in export order. Local: no collective."""
    _dtype(dtype)
    hf = _hf_model(model)
    return [WeightSpec(name=n, shape=tuple(t.shape), dtype=dtype) for name, p in model.named_parameters()
            for n, t in checkpoint_layout(hf, {hf_name(name): torch.empty(p.shape, device="meta")})]


def export_buckets(model: nn.Module, bucket_bytes: int, dtype: str) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full tensors cast to ``dtype`` in buckets of at most ``bucket_bytes`` (a larger tensor goes
    alone). Each DTensor is gathered with ``full_tensor()``, a collective: every rank iterates."""
    target = _dtype(dtype)
    hf = _hf_model(model)

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            yield from checkpoint_layout(hf, {hf_name(name): full.detach().to(target)})

    return iter_buckets(named(), bucket_bytes)


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
