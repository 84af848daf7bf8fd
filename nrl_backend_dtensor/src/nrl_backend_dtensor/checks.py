"""What ``nrl config check`` asks of the DTensor backend (its spec's ``config_check``).

Everything a worker would refuse at start that does not need a process group or a model: the
context-parallel size, tensor parallelism against the model's heads (from its ``config.json``),
the custom parallel plan's import path, and the optimizer and scheduler, which are built here over
a one-element parameter so a wrong name, a negative learning rate or a bad keyword fails now, in
one line, instead of in every worker. The workers run the same functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from nrl_core.api import ConfigError, PluginError, has_recurrent_layers, import_object, local_model_config

KEY = "policy.dtensor_config"
# Optimizer keywords that choose a device implementation; a CPU stand-in parameter cannot judge them.
_DEVICE_KWARGS = ("fused", "foreach", "capturable", "differentiable")


def check_config(config: Mapping[str, Any]) -> None:
    policy = config["policy"]
    section = policy["dtensor_config"]
    check_context_parallel(int(section["context_parallel_size"]))
    hf_config = local_model_config(config)
    if hf_config is not None:
        check_heads(int(section["tensor_parallel_size"]), hf_config)
        check_packing(policy, hf_config)
    if section["custom_parallel_plan"]:
        resolve_parallel_plan(section["custom_parallel_plan"])
    if section["lora_cfg"]["enabled"]:
        from nrl_backend_dtensor.lora import check_section

        if policy["reward_model_cfg"]["enabled"]:
            raise ConfigError(f"{KEY}.lora_cfg.enabled", "LoRA on a model with a value head (policy.reward_model_cfg) "
                                                        "is not supported; train its full weights")
        check_section(section["lora_cfg"], int(section["tensor_parallel_size"]))
    elif policy["refit"]["adapters"]:
        raise ConfigError("policy.refit.adapters", "adapter-only refit sends LoRA adapters, and this run trains "
                                                   "full weights; enable policy.dtensor_config.lora_cfg or set it false")
    check_optimizer(policy)


def check_context_parallel(cp_size: int) -> None:
    if cp_size != 1:
        raise ConfigError(f"{KEY}.context_parallel_size",
                          f"context parallelism is not supported by the dtensor backend; set it to 1 (got {cp_size})")


def check_heads(tp_size: int, hf_config: Any) -> None:
    """Tensor parallelism splits attention by heads: ``tp_size`` must divide both head counts."""
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(hf_config, name, None)
        if heads is not None and heads % tp_size:
            raise ConfigError(f"{KEY}.tensor_parallel_size", f"{tp_size} does not divide the model's {name}={heads}")


def check_packing(policy: Mapping[str, Any], hf_config: Any) -> None:
    """Packed sequences share a row; transformers' Mamba and linear-attention layers would carry
    their state from one sequence into the next (they have no per-sequence resets on this path)."""
    if (policy.get("sequence_packing") or {}).get("enabled") and has_recurrent_layers(hf_config):
        raise ConfigError("policy.sequence_packing.enabled",
                          f"a {hf_config.model_type} model has Mamba or linear-attention layers, whose state the "
                          "dtensor backend cannot reset between packed sequences; set it to false")


def resolve_parallel_plan(path: str) -> Callable[..., Any]:
    """The callable named by ``custom_parallel_plan`` (``module:function``)."""
    try:
        factory = import_object(path)
    except PluginError as exc:
        raise ConfigError(f"{KEY}.custom_parallel_plan", str(exc)) from None
    if not callable(factory):
        raise ConfigError(f"{KEY}.custom_parallel_plan", f"'{path}' is not callable")
    return factory


def check_optimizer(policy: Mapping[str, Any]) -> None:
    """Build ``policy.optimizer`` and ``policy.scheduler`` over a stand-in parameter."""
    import torch

    from nrl_backend_dtensor.optim import build_optimizer, build_scheduler

    cfg = dict(policy.get("optimizer") or {})
    cfg["kwargs"] = {k: v for k, v in (cfg.get("kwargs") or {}).items() if k not in _DEVICE_KWARGS}
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg)
    build_scheduler(optimizer, policy.get("scheduler"))
