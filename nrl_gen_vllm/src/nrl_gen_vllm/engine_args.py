"""``policy.generation.vllm_kwargs``: the user's own arguments for vLLM's engine (NeMo RL's key).

They go to ``vllm.LLM`` / ``AsyncEngineArgs`` as given, as in NeMo RL, except the arguments nrl sets
itself: NeMo RL passes both and Python refuses the duplicate, so nrl refuses it in one line naming
the key that sets it instead (a repeat of nrl's own value passes). Names vLLM does not know are
refused at ``nrl config check`` when vLLM is importable there, and at engine start otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import ConfigError, value_at

KEY = "policy.generation.vllm_kwargs"
#: Engine arguments nrl sets, with the key that sets them (None: nrl's own machinery).
SET_BY_NRL: Mapping[str, str | None] = {
    "model": "policy.model_name",
    "tokenizer": "policy.tokenizer.name",
    "dtype": "policy.generation.vllm_cfg.precision",
    "seed": "policy.generation.vllm_cfg.seed",
    "max_model_len": "policy.generation.vllm_cfg.max_model_len",
    "tensor_parallel_size": "policy.generation.vllm_cfg.tensor_parallel_size",
    "pipeline_parallel_size": "policy.generation.vllm_cfg.pipeline_parallel_size",
    "gpu_memory_utilization": "policy.generation.vllm_cfg.gpu_memory_utilization",
    "enforce_eager": "policy.generation.vllm_cfg.enforce_eager",
    "trust_remote_code": "policy.trust_remote_code",
    "kv_cache_dtype": "policy.generation.vllm_cfg.kv_cache_dtype",
    "kv_cache_memory_bytes": "policy.generation.vllm_cfg.kv_cache_space_gb",
    "logprobs_mode": "policy.generation.vllm_cfg.logprobs_mode",
    "load_format": "policy.generation.vllm_cfg.load_format",
    "enable_expert_parallel": "policy.generation.vllm_cfg.expert_parallel_size",
    "enable_lora": "policy.refit.adapters",
    "max_lora_rank": "policy.generation.vllm_cfg.max_lora_rank",
    "max_loras": "policy.refit.adapters",
    "disable_log_stats": "policy.generation.vllm_cfg.enable_vllm_metrics_logger",
    "worker_extension_cls": None,  # nrl's refit extension
    "enable_sleep_mode": None,  # follows colocation
    "distributed_executor_backend": None,  # follows the engine's placement
}
def _nrl_value(config: Mapping[str, Any], path: str) -> Any:
    value = value_at(config, path)
    if path == "policy.tokenizer.name" and value is None:
        return config["policy"]["model_name"]
    return value


def check_user_engine_kwargs(config: Mapping[str, Any]) -> None:
    """Refuse, in one line, an argument nrl sets itself, unless it repeats the value nrl sets
    (NeMo RL's recipes write ``tokenizer: ${policy.tokenizer.name}``)."""
    for name, value in (config["policy"]["generation"].get("vllm_kwargs") or {}).items():
        if name not in SET_BY_NRL:
            continue
        owner = SET_BY_NRL[name]
        if owner is not None and value == _nrl_value(config, owner):
            continue
        where = f"set it with {owner}" if owner else "remove it"
        raise ConfigError(f"{KEY}.{name}", f"nrl sets this vLLM argument itself; {where}")


def check_names_known(config: Mapping[str, Any]) -> None:
    """Refuse a name vLLM's engine arguments lack (only when there are any: importing vLLM's
    argument table costs seconds)."""
    given = config["policy"]["generation"].get("vllm_kwargs") or {}
    if not given:
        return
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in given:
        if name not in known:
            raise ConfigError(f"{KEY}.{name}", "vLLM's engine has no such argument (vllm.engine.arg_utils.EngineArgs); "
                                               "check the spelling against the installed vLLM")


def user_engine_kwargs(config: Mapping[str, Any], nrl_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The user's arguments to add to the engine's, refused in one line where they would replace
    one nrl sets (``nrl_kwargs``: what nrl passes besides the fixed ones, such as whole-prompt
    prefill on CPU, which seeded sampling needs); those that repeat nrl's value are left to nrl,
    and so are those set to None (YAML's null: not set, so nrl's value where nrl sets one, else
    vLLM's default)."""
    check_user_engine_kwargs(config)
    given = {k: v for k, v in (config["policy"]["generation"].get("vllm_kwargs") or {}).items()
             if k not in SET_BY_NRL and v is not None}
    for name in given:
        if name in nrl_kwargs:
            raise ConfigError(f"{KEY}.{name}", f"nrl sets this vLLM argument itself on this engine (to "
                                               f"{nrl_kwargs[name]!r}); remove it")
    return given
