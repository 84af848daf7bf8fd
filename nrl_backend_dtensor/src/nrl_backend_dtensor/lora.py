"""LoRA on the DTensor backend, with Hugging Face PEFT's layers.

``policy.dtensor_config.lora_cfg`` takes NeMo RL's keys (its Automodel LoRA) and becomes a PEFT
``LoraConfig``; :func:`inject` puts the adapters into the HF model in place (``q_proj`` becomes a
PEFT ``Linear`` holding ``base_layer``, ``lora_A`` and ``lora_B``), freezes every base weight and
leaves only the adapters trainable, so the optimizer never holds state for the base.

What leaves the worker stays a plain model: :func:`merged_named_tensors` gives every weight under
its HF name with the adapter folded in (``W + alpha/r * B @ A``), which is what refit sends to the
generation engine and what the HF export writes. The reference policy for the KL term is the base
model with the adapters switched off (:func:`adapters_disabled`), so no second copy of the
weights is kept.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nrl_backend_dtensor.weights import full_tensor
from nrl_core.api import ConfigError

KEY = "policy.dtensor_config.lora_cfg"
ADAPTER = "default"  # PEFT's name for the one adapter


def enabled(section: Mapping[str, Any] | None) -> bool:
    return bool((section or {}).get("enabled"))


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is an adapter's (PEFT names them ``...lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def check_section(section: Mapping[str, Any], tensor_parallel_size: int) -> None:
    """What PEFT's layers cannot do as NeMo RL's keys ask, in one line each."""
    if tensor_parallel_size > 1:
        raise ConfigError(f"{KEY}.enabled", "LoRA on the dtensor backend runs with FSDP data parallelism only; set "
                                            f"policy.dtensor_config.tensor_parallel_size to 1 (got {tensor_parallel_size})")
    if section["dropout"] > 0 and section["dropout_position"] == "post":
        raise ConfigError(f"{KEY}.dropout_position", "'post' (dropout on the adapter's output) is not what PEFT's "
                                                     "LoRA does; use 'pre' (dropout on its input) or dropout: 0")


def _patterns(names: list[str]) -> Any:
    """NeMo RL's module names: plain names match a module name's last parts (PEFT's rule), names
    with ``*`` are globs over the whole dotted name (a regex for PEFT)."""
    if not any("*" in n or "?" in n for n in names):
        return list(names)
    return "|".join(fnmatch.translate(n).removeprefix("(?s:").removesuffix(")\\Z") for n in names)


def lora_config(section: Mapping[str, Any]) -> Any:
    """PEFT's ``LoraConfig`` for ``lora_cfg`` (NeMo RL's keys)."""
    from peft import LoraConfig

    # no target named reads as every linear layer (but the excluded ones), as NeMo Automodel reads it
    every_linear = section["match_all_linear"] or not section["target_modules"]
    targets = "all-linear" if every_linear else _patterns(list(section["target_modules"]))
    excluded = _patterns(list(section["exclude_modules"])) if section["exclude_modules"] else None
    return LoraConfig(r=int(section["dim"]), lora_alpha=float(section["alpha"]), lora_dropout=float(section["dropout"]),
                      target_modules=targets, exclude_modules=excluded, bias="none", task_type="CAUSAL_LM",
                      init_lora_weights=True)


def inject(model: nn.Module, section: Mapping[str, Any], seed: int) -> None:
    """Add the adapters to ``model`` in place and freeze the rest.
    ``lora_A_init: xavier`` re-draws A with Xavier-uniform (PEFT's own is Kaiming-uniform, NeMo
    RL's ``uniform``); B starts at zero either way, so the model starts as the base model."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(lora_config(section), model)
        except ValueError as exc:  # PEFT: "Target modules ... not found in the base model"
            raise ConfigError(f"{KEY}.target_modules", f"matches no linear layer of the model "
                                                       f"({' '.join(str(exc).split())[:200]})") from None
        layers = list(lora_layers(model))
        if section["lora_A_init"] == "xavier":
            for layer in layers:
                nn.init.xavier_uniform_(layer.lora_A[ADAPTER].weight)
    if not layers:
        raise ConfigError(f"{KEY}.target_modules", f"matches no linear layer of the model ({section['target_modules']}"
                                                   f" excluding {section['exclude_modules']})")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))


def lora_layers(model: nn.Module) -> Iterator[Any]:
    from peft.tuners.lora import LoraLayer

    return (m for m in model.modules() if isinstance(m, LoraLayer))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off for the block (the reference policy)."""
    layers = list(lora_layers(model))
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every base weight, the adapter merged in where there is one, in
    the order of ``named_parameters`` and named as without adapters. Collective under FSDP (each
    tensor is gathered): every rank iterates."""
    layers = set(lora_layers(model))
    owners = {f"{name}.base_layer.weight": layer for name, layer in model.named_modules() if layer in layers}
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        full = full_tensor(param).detach()
        layer = owners.get(name)
        if layer is not None:
            a = full_tensor(layer.lora_A[ADAPTER].weight).detach().float()
            b = full_tensor(layer.lora_B[ADAPTER].weight).detach().float()
            full = (full.float() + layer.scaling[ADAPTER] * (b @ a)).to(full.dtype)
        yield name.replace(".base_layer", ""), full


def merged_shapes(model: nn.Module) -> Iterator[tuple[str, torch.Size]]:
    """The names and global shapes :func:`merged_named_tensors` yields, without a collective."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            continue
        yield name.replace(".base_layer", ""), param.shape


def adapter_shapes(model: nn.Module) -> dict[str, list[int]]:
    """The adapters' names and global shapes (a checkpoint of another rank or targets differs here)."""
    return {name: list(p.shape) for name, p in model.named_parameters() if is_adapter_name(name)}


def _peft_name(name: str) -> str:
    return "base_model.model." + name.removeprefix("hf.").replace(f".{ADAPTER}.", ".")


def peft_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every adapter, whole, under the name PEFT's ``adapter_model.safetensors`` gives it
    (``base_model.model.<module>.lora_A.weight``). Collective under FSDP: every rank iterates."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            yield _peft_name(name), full_tensor(param)


def peft_shapes(model: nn.Module) -> Iterator[tuple[str, torch.Size]]:
    """The names and global shapes :func:`peft_named_tensors` yields, without a collective."""
    for name, param in model.named_parameters():
        if is_adapter_name(name):
            yield _peft_name(name), param.shape


def peft_config(section: Mapping[str, Any], base_model: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of these adapters, as plain JSON values."""
    from nrl_core.api import plain_config

    config = lora_config(section)
    config.base_model_name_or_path = base_model
    return plain_config(config.to_dict())


def write_adapter(model: nn.Module, section: Mapping[str, Any], base_model: str, path: str, *,
                  tokenizer_source: str, writer: bool) -> None:
    """The adapters as a PEFT adapter directory that ``PeftModel.from_pretrained(base, path)``
    loads. Collective under FSDP (each adapter is gathered): every rank calls it."""
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    from nrl_core.api import copy_tokenizer

    state = {name: tensor.detach().cpu().contiguous() for name, tensor in peft_named_tensors(model)}
    if writer:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = lora_config(section)
        config.base_model_name_or_path = base_model
        config.save_pretrained(str(out))
        copy_tokenizer(tokenizer_source, out)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
