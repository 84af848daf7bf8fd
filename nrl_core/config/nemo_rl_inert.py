"""Which inert NeMo RL keys a config's warning names, and why each one means nothing in nrl.

A NeMo RL key nrl does not implement is accepted (:mod:`nrl_core.config.nemo_rl`); three rules
decide what happens when a config sets it:

* **Settings of a feature the config leaves off** are not named: a key under a section whose
  ``enabled`` is false (``megatron_cfg`` in a DTensor recipe, ``draft``, ``fp8_cfg``,
  ``data_plane``), or under a switch the config does not turn on (:data:`GATES`). They mean
  nothing in NeMo RL for that config either.
* **Keys with a value that is nrl's behaviour** (:data:`NEUTRAL`) pass silently at that value and
  are refused in one line at any other, since the run would compute something else.
* **Keys that mean nothing in nrl** (:data:`REASONS`, each with the reason docs/configuration.md
  gives) are named in the one warning. So is any other inert key, until it earns a reason here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nrl_core.config.loader import value_at
from nrl_core.errors import ConfigError


@dataclass(frozen=True)
class Neutral:
    """``values`` are what nrl does (``nrl_does``); another value would change the run."""

    values: tuple[Any, ...]
    nrl_does: str


NEUTRAL: Mapping[str, Neutral] = {
    "grpo.val_num_generations_per_prompt": Neutral((1,), "validation samples one response per prompt"),
    "policy.sequence_packing.microbatch_order": Neutral(("packer",), "micro-batches run in the packer's order"),
    "policy.megatron_cfg.cuda_graph_impl": Neutral(("none",), "Megatron trains without CUDA graphs"),
    "policy.draft.enabled": Neutral((False,), "no draft model trains beside the policy (NeMo RL trains an Eagle-3 "
                                              "draft for vLLM's speculative decoding)"),
}

REASONS: Mapping[str, str] = {
    "policy.generation.port_range_low": "nrl asks the operating system for free ports",
    "policy.generation.port_range_high": "nrl asks the operating system for free ports",
    "cluster.master_port_range_low": "nrl asks the operating system for free ports",
    "cluster.master_port_range_high": "nrl asks the operating system for free ports",
    "policy.megatron_cfg.defer_fp32_logits":
        "where the logits become float32, not their values (bfloat16 to float32 is exact): nrl's Megatron "
        "backend casts them as the model returns them, so it lacks NeMo RL's memory saving, not its results",
    "policy.generation.vllm_cfg.enable_vllm_metrics_logger":
        "logging only: NeMo RL plots its async engine's running and waiting requests, KV cache use and token "
        "counts per worker; nrl does not collect them, and the run computes the same",
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval": "the sampling period of the plots above",
    "logger.monitor_gpus":
        "logging only: NeMo RL plots each GPU's utilisation and memory from Ray's metrics endpoint; nrl does "
        "not collect them, and the run computes the same",
    "policy.megatron_cfg.checkpoint.ckpt_assume_constant_structure":
        "a Megatron save-time shortcut (reuse the first save's plan); nrl plans each save, and the files "
        "written are the same",
}

_NEMO_RL_SINKS = ("wandb", "tensorboard", "mlflow", "swanlab")


def _async_engine(raw: Mapping[str, Any]) -> bool:
    return bool(value_at(raw, "policy.generation.vllm_cfg.async_engine"))


def _nemo_rl_logger_on(raw: Mapping[str, Any]) -> bool:
    return any(value_at(raw, f"logger.{sink}_enabled") for sink in _NEMO_RL_SINKS)


def _cuda_graphs(raw: Mapping[str, Any]) -> bool:
    return value_at(raw, "policy.megatron_cfg.cuda_graph_impl") not in (None, "none")


#: Inert keys under a switch: named only when ``on(raw config)`` is true (else the feature is off).
GATES: Mapping[str, Callable[[Mapping[str, Any]], bool]] = {
    "policy.generation.mcore_generation_config.":
        lambda raw: value_at(raw, "policy.generation.backend") == "megatron",  # refused by the backend check
    "policy.generation.refit_cfg.nixl.":
        lambda raw: value_at(raw, "policy.generation.refit_transport") == "nixl",
    "policy.generation.real_quant_export_cpu_offload":
        lambda raw: bool(value_at(raw, "policy.generation.real_quant")),
    "policy.megatron_cfg.fused_linear_logprobs_chunk_size":
        lambda raw: bool(value_at(raw, "policy.megatron_cfg.use_fused_linear_logprobs")),
    "policy.megatron_cfg.cuda_graph_warmup_steps": _cuda_graphs,
    "policy.megatron_cfg.cuda_graph_modules": _cuda_graphs,
    # NeMo RL collects vLLM's gauges from its async engine only
    "policy.generation.vllm_cfg.enable_vllm_metrics_logger": _async_engine,
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval": _async_engine,
    # NeMo RL's GPU monitor writes to W&B, TensorBoard, MLflow or SwanLab only
    "logger.monitor_gpus": _nemo_rl_logger_on,
    "logger.gpu_monitoring.": _nemo_rl_logger_on,
}


def _feature_off(raw: Mapping[str, Any], path: str) -> bool:
    """True when a section above ``path`` says ``enabled: false``, or a gate of :data:`GATES` is off."""
    parts = path.split(".")
    for depth in range(1, len(parts)):
        section = value_at(raw, ".".join(parts[:depth]))
        if isinstance(section, Mapping) and section.get("enabled") is False:
            return True
    return any(path.startswith(prefix) and not on(raw) for prefix, on in GATES.items())


def named_inert_keys(noted: Sequence[tuple[str, Any]], raw: Mapping[str, Any]) -> list[str]:
    """The keys of ``noted`` (path, value: inert keys a config set) that the warning names; raises
    the one-line error for a key set to something nrl does not do."""
    named = []
    for path, value in noted:
        if _feature_off(raw, path):
            continue
        neutral = NEUTRAL.get(path)
        if neutral is not None:
            if value in neutral.values:
                continue
            shown = " or ".join(repr(v) for v in neutral.values if v is not None)
            raise ConfigError(path, f"{value!r} is a NeMo RL feature nrl lacks: in nrl {neutral.nrl_does} "
                                    f"(NeMo RL's {shown}); set it to {shown} or remove it")
        named.append(path)
    return named
