"""Mixture-of-experts models in the DTensor backend: router statistics and what is not supported.

FSDP2 shards a MoE layer like any other: transformers keeps each layer's experts as fused 3-D
parameters (``[experts, 2 * width, hidden]``), which ``fully_shard`` splits along the expert
dimension. Tensor parallelism of experts is not implemented (the default plan names dense MLP
projections a MoE layer does not have), so a MoE model with ``tensor_parallel_size > 1`` is refused.

Router statistics (:mod:`nrl_core.moe`) come from forward hooks on transformers' top-k routers,
whose output is ``(router_logits, router_scores, router_indices)`` over the flattened ``[b * S]``
tokens.
"""

from __future__ import annotations

import re
from typing import Any

import torch.distributed as dist
from torch import nn

from nrl_core.api import ConfigError, RouterStats, all_reduce, balance_metrics

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_moe(hf_config: Any) -> bool:
    return int(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0) or 0) > 0


def check_tensor_parallel(hf_config: Any, tp_size: int) -> None:
    if tp_size > 1 and is_moe(hf_config):
        raise ConfigError("policy.dtensor_config.tensor_parallel_size",
                          f"{tp_size} is not supported for a mixture-of-experts model in the dtensor backend; set 1 "
                          "(FSDP2 shards the experts) or use the Megatron backend's expert_model_parallel_size")


def _routers(hf_model: nn.Module) -> list[tuple[int, nn.Module]]:
    found = []
    for name, module in hf_model.named_modules():
        match = _LAYER.search(name + ".")
        if match and type(module).__name__.endswith("Router") and hasattr(module, "top_k") \
                and hasattr(module, "num_experts"):
            found.append((int(match.group(1)), module))
    return found


class RouterMetrics:
    """Hooks on every router of ``hf_model``; :meth:`collect` gives the step's metrics."""

    def __init__(self, hf_model: nn.Module, routers: list[tuple[int, nn.Module]]) -> None:
        first = routers[0][1]
        self.stats = RouterStats(hf_model.config.num_hidden_layers, int(first.num_experts), int(first.top_k))
        for layer, module in routers:
            module.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, hf_model: nn.Module) -> RouterMetrics | None:
        routers = _routers(hf_model)
        return cls(hf_model, routers) if routers else None

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.stats.active:
                logits, _, indices = output
                valid = None if self.stats.valid is None else self.stats.valid.reshape(-1)
                self.stats.add(layer, logits, indices, valid)
        return hook

    def collect(self, group: dist.ProcessGroup) -> dict[str, float]:
        """Sum over ``group`` (the data-parallel ranks) and compute; collective."""
        totals = self.stats.totals()
        all_reduce(totals, group=group)
        self.stats.reset()
        return balance_metrics(totals, self.stats.num_experts, self.stats.topk)

