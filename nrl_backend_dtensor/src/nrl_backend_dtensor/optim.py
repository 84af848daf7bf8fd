"""Optimizer and learning-rate schedule from NeMo RL-shaped config, and DTensor-safe clipping."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nrl_backend_dtensor.fused_adam import TE_FUSED_ADAM, FusedAdam
from nrl_core.api import ConfigError

log = logging.getLogger(__name__)


def _import_dotted(name: str, key_path: str) -> Any:
    module_name, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(key_path, f"cannot import '{name}'; give a dotted path like 'torch.optim.AdamW'") from None


def _optimizer_class(name: str) -> Any:
    """The class ``name`` names; TE's FusedAdam runs as nrl's torch version where Transformer
    Engine cannot run it (not installed, no CUDA device, or an import that fails)."""
    if name == TE_FUSED_ADAM and not _transformer_engine_runs():
        log.warning("policy.optimizer.name: Transformer Engine cannot run here (not installed, or no CUDA device), "
                    "so its FusedAdam update runs in torch ops (nrl_backend_dtensor.fused_adam)")
        return FusedAdam
    return _import_dotted(name, "policy.optimizer.name")


def _transformer_engine_runs() -> bool:
    if importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - a build without its CUDA libraries fails in many ways
        return False
    return True


def _torch_values(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """NeMo RL's optimizer kwargs spell dtypes as strings (``torch.bfloat16``); read them as torch's."""
    resolved = {}
    for key, value in kwargs.items():
        if isinstance(value, str) and value.startswith("torch."):
            value = getattr(torch, value.removeprefix("torch."), None)
            if value is None:
                raise ConfigError(f"policy.optimizer.kwargs.{key}", f"torch has no '{kwargs[key]}'")
        resolved[key] = value
    return resolved


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """``{name: "torch.optim.AdamW", kwargs: {...}}`` -> the optimizer over ``params``."""
    cls = _optimizer_class(cfg.get("name", "torch.optim.AdamW"))
    kwargs = _torch_values(dict(cfg.get("kwargs") or {}))
    try:
        return cls(list(params), **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError("policy.optimizer.kwargs", str(exc).splitlines()[0]) from None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any) -> torch.optim.lr_scheduler.LRScheduler:
    """NeMo RL's scheduler config -> one scheduler (constant when ``cfg`` is null).

    ``cfg`` is a list of ``{name, kwargs}`` items plus at most one ``{milestones: [...]}`` item,
    which chains them with ``SequentialLR``; a single item (or a bare mapping) is used directly.
    """
    if not cfg:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    items = [cfg] if isinstance(cfg, Mapping) else list(cfg)
    milestones = None
    schedulers = []
    for i, item in enumerate(items):
        path = f"policy.scheduler[{i}]"
        if "milestones" in item:
            milestones = list(item["milestones"])
            continue
        cls = _import_dotted(item.get("name", ""), f"{path}.name")
        try:
            schedulers.append(cls(optimizer, **dict(item.get("kwargs") or {})))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}.kwargs", str(exc).splitlines()[0]) from None
    if len(schedulers) == 1 and not milestones:
        return schedulers[0]
    if milestones is None or len(milestones) != len(schedulers) - 1:
        raise ConfigError("policy.scheduler", f"{len(schedulers)} schedulers need {len(schedulers) - 1} milestones "
                          f"in a '- milestones: [...]' item, got {milestones}")
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers, milestones=milestones)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Total L2 norm of all gradients (before clipping); scale them to ``max_norm`` when set.

    Written out rather than ``torch.nn.utils.clip_grad_norm_`` because with tensor parallelism the
    gradients live on different meshes (``dp`` for embeddings, ``dp x tp`` for layers) and the
    fused foreach norm refuses to mix them; each DTensor norm is reduced over its own mesh here.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total_sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        n = g.norm(2)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        total_sq += n.detach().double().cpu() ** 2
    total = math.sqrt(float(total_sq))
    if max_norm is not None and max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for g in grads:
            g.mul_(coef)
    return total
