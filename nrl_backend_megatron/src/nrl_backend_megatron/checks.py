"""What ``nrl config check`` asks of the Megatron backend (its spec's ``config_check``).

The parallel layout against the world and the model (heads, key/value groups, vocabulary and
layers from the model's ``config.json``), the architecture and RoPE variant, the modules selective
activation recompute names (:mod:`nrl_backend_megatron.memory`), optimizer and
scheduler values Megatron-Core would refuse or misuse (a negative learning rate trains backwards
without complaint), and micro-batches that must split each data-parallel shard evenly. The worker
runs the same functions when it starts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nrl_core.api import ConfigError, cluster_topology, local_model_config

KEY = "policy.megatron_cfg"


def check_config(config: Mapping[str, Any]) -> None:
    from nrl_backend_megatron.convert.families import family_of
    from nrl_backend_megatron.memory import check_recompute
    from nrl_backend_megatron.model import hf_inv_freq, transformer_engine_installed
    from nrl_backend_megatron.moe import check_moe_section
    from nrl_backend_megatron.parallel import check_layout

    policy = config["policy"]
    section = policy["megatron_cfg"]
    world = cluster_topology(config).train_world
    layout = layout_of(section)
    hf_config = local_model_config(config)
    check_layout(layout, world, hf_config)
    if hf_config is not None:
        # what needs CUDA is checked where the worker runs: configs are often checked on a login node
        check_moe_section(section, hf_config, on_gpu=True)
        if family_of(hf_config).hybrid:
            from nrl_backend_megatron.hybrid import check_hybrid

            check_hybrid(hf_config, layout.tp)
        else:
            hf_inv_freq(hf_config)  # refuses RoPE variants the backend cannot reproduce
        if family_of(hf_config).gpt_oss:
            from nrl_backend_megatron import gpt_oss

            gpt_oss.config_kwargs(hf_config)  # refuses what Megatron-Core's pieces would compute otherwise
    check_value_head(policy, section, hf_config)
    # Transformer Engine with CUDA is only known where the workers run (they check again); not installed, never
    check_recompute(section, hf_config, transformer_engine=transformer_engine_installed())
    if (section.get("peft") or {}).get("enabled"):
        from nrl_backend_megatron.lora import check_section

        # Transformer Engine's layers are only known where the workers run; they check again
        check_section(section["peft"], transformer_engine=False)
    elif policy["refit"]["adapters"]:
        raise ConfigError("policy.refit.adapters", "adapter-only refit sends LoRA adapters, and this run trains "
                                                   "full weights; enable policy.megatron_cfg.peft or set it false")
    if section.get("pretrained_checkpoint"):
        check_pretrained(section["pretrained_checkpoint"], hf_config, str(policy["model_name"]))
    logging_level(section["logging_level"])
    check_optimizer_section(section)
    dp = world // (layout.tp * layout.pp * layout.cp)
    if policy["dynamic_batching"]["enabled"] and layout.pp > 1:
        raise ConfigError("policy.dynamic_batching.enabled", f"micro-batches of different shapes cannot pass between "
                                                              f"{layout.pp} pipeline stages; set it to false or "
                                                              "pipeline_model_parallel_size to 1")
    if not policy["sequence_packing"]["enabled"] and not policy["dynamic_batching"]["enabled"]:
        local, mbs = policy["train_global_batch_size"] // dp, policy["train_micro_batch_size"]
        if local % mbs:
            raise ConfigError("policy.train_micro_batch_size",
                              f"{mbs} does not divide the {local} sequences of each of the {dp} data-parallel ranks "
                              f"(policy.train_global_batch_size / data-parallel size); Megatron's pipeline needs "
                              f"equal micro-batches")


def check_value_head(policy: Mapping[str, Any], section: Mapping[str, Any], hf_config: Any) -> None:
    """A value head (``policy.reward_model_cfg``) where the backend builds one as tested, one line
    otherwise: not with LoRA (adapters are not placed on the head), a mixture-of-experts model or a
    Megatron checkpoint to start from (untested); and the checkpoint's own head (``hf_config``, None when
    the model is not local) of the kind asked for."""
    from nrl_backend_megatron.value_head import check_source
    from nrl_core.api import value_head_type

    kind = value_head_type(policy)
    if hf_config is not None:
        check_source(hf_config, kind, str(policy["model_name"]))
    if kind is None:
        return
    why = "with a value head (policy.reward_model_cfg.enabled) is not supported by the Megatron backend"
    if (section.get("peft") or {}).get("enabled"):
        raise ConfigError(f"{KEY}.peft.enabled", f"LoRA {why}; train the full weights")
    if section.get("pretrained_checkpoint"):
        raise ConfigError(f"{KEY}.pretrained_checkpoint", f"starting from a Megatron checkpoint {why}; start from "
                                                          "the Hugging Face model (policy.model_name)")
    if hf_config is not None:
        from nrl_backend_megatron.moe import is_moe

        if is_moe(hf_config):
            raise ConfigError("policy.model_name", f"a mixture-of-experts model {why}; use the DTensor backend")


def check_pretrained(path: str, hf_config: Any, model_name: str) -> None:
    """The Megatron checkpoint to start from, as far as the driver can tell: its layout, the
    architecture it records against the HF config, and its shard files (the tensors' shapes are
    checked by the workers, which build the model)."""
    from nrl_backend_megatron.convert.megatron_checkpoint import MegatronCheckpointError, locate_checked

    try:
        locate_checked(path, hf_config, model_name)
    except MegatronCheckpointError as exc:
        raise ConfigError(f"{KEY}.pretrained_checkpoint", str(exc)) from None


def layout_of(section: Mapping[str, Any]) -> Any:
    from nrl_backend_megatron.model import ParallelLayout

    return ParallelLayout(tp=int(section["tensor_model_parallel_size"]), pp=int(section["pipeline_model_parallel_size"]),
                          cp=int(section["context_parallel_size"]), ep=int(section.get("expert_model_parallel_size") or 1),
                          sequence_parallel=bool(section["sequence_parallel"]))


def logging_level(level: int | str) -> int:
    """``logging_level`` as a number (``"INFO"`` or ``20``)."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else int(level)
    if not isinstance(numeric, int):
        raise ConfigError(f"{KEY}.logging_level", f"unknown logging level {level!r}")
    return numeric


def check_optimizer_section(section: Mapping[str, Any]) -> None:
    """Optimizer, scheduler and DDP values Megatron-Core accepts but cannot mean."""
    opt, sched = section["optimizer"], section["scheduler"]
    if opt["min_lr"] > opt["lr"]:
        raise ConfigError(f"{KEY}.optimizer.min_lr", f"{opt['min_lr']} exceeds optimizer.lr={opt['lr']}; lower it")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= opt[key] < 1:
            raise ConfigError(f"{KEY}.optimizer.{key}", f"must be in [0, 1), got {opt[key]}")
    if opt["adam_eps"] <= 0:
        raise ConfigError(f"{KEY}.optimizer.adam_eps", f"must be positive, got {opt['adam_eps']}")
    style, decay_iters, warmup = sched["lr_decay_style"], sched["lr_decay_iters"], sched["lr_warmup_iters"]
    if decay_iters is None and style != "constant":
        raise ConfigError(f"{KEY}.scheduler.lr_decay_iters", f"is required for lr_decay_style '{style}'")
    if decay_iters is not None and decay_iters <= warmup and style != "constant":
        raise ConfigError(f"{KEY}.scheduler.lr_decay_iters", f"must exceed lr_warmup_iters ({warmup})")
    wd = opt["weight_decay"]
    start_wd = wd if sched["start_weight_decay"] is None else sched["start_weight_decay"]
    end_wd = wd if sched["end_weight_decay"] is None else sched["end_weight_decay"]
    if sched["weight_decay_incr_style"] == "constant" and start_wd != end_wd:
        raise ConfigError(f"{KEY}.scheduler.end_weight_decay",
                          "must equal start_weight_decay when weight_decay_incr_style is constant")
    if section["distributed_data_parallel_config"]["overlap_param_gather"] and not opt["use_distributed_optimizer"]:
        raise ConfigError(f"{KEY}.distributed_data_parallel_config.overlap_param_gather",
                          f"needs {KEY}.optimizer.use_distributed_optimizer: true")
