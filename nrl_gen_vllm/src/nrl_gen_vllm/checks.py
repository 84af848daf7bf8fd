"""What ``nrl config check`` asks of the vLLM backend (its spec's ``config_check``), and the two
engine-start refusals that are user errors.

Before a run: the engine's ``max_model_len`` (``vllm_cfg.max_model_len``, else
``policy.max_total_sequence_length``) against the model's position limit as vLLM derives it, and
against the training length (responses past it would be cut before training); tensor parallelism
against the model's heads; expert parallelism against the engine's tensor-parallel size and the
model's experts; memory fractions in range. At engine start vLLM may still refuse a KV
cache too small for one sequence, which depends on the machine: :func:`engine_start_error` turns
that, and vLLM's own length refusal, into one line naming the key to change.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nrl_core.api import ConfigError, in_flight_section, local_model_config
from nrl_gen_vllm.engine_args import check_names_known, check_user_engine_kwargs

KEY = "policy.generation.vllm_cfg"
# config.json keys vLLM takes the model's length limit from (the smallest present wins).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")
# RoPE variants whose max_position_embeddings is already the scaled length (vLLM does not multiply).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def length_key(config: Mapping[str, Any]) -> str:
    """The key that sets the engine's ``max_model_len`` in this config."""
    vcfg = config["policy"]["generation"]["vllm_cfg"]
    return f"{KEY}.max_model_len" if vcfg.get("max_model_len") else "policy.max_total_sequence_length"


def check_config(config: Mapping[str, Any]) -> None:
    policy = config["policy"]
    generation = policy["generation"]
    vcfg = generation["vllm_cfg"]
    if vcfg.get("precision") == "fp8":
        raise ConfigError(f"{KEY}.precision", "fp8 rollouts (NeMo RL's FP8 generation) are a feature nrl lacks; "
                                              "use bfloat16, or null to follow policy.precision")
    check_user_engine_kwargs(config)
    check_names_known(config)
    if not 0 < vcfg["gpu_memory_utilization"] <= 1:
        raise ConfigError(f"{KEY}.gpu_memory_utilization", f"must be in (0, 1], got {vcfg['gpu_memory_utilization']}")
    if vcfg["kv_cache_space_gb"] is not None and vcfg["kv_cache_space_gb"] <= 0:
        raise ConfigError(f"{KEY}.kv_cache_space_gb", f"must be positive, got {vcfg['kv_cache_space_gb']}")
    total = policy["max_total_sequence_length"]
    max_len = vcfg["max_model_len"] or total
    if max_len > total:
        raise ConfigError(f"{KEY}.max_model_len",
                          f"{max_len} exceeds policy.max_total_sequence_length={total}: responses past it would be "
                          f"cut before training; set it to at most {total} (null follows it)")
    tp = vcfg["tensor_parallel_size"]  # engines tiling the generation ranks: nrl_core/config/topology.py
    if (config.get("grpo") or {}).get("async_grpo", {}).get("enabled") and not vcfg["async_engine"]:
        raise ConfigError(f"{KEY}.async_engine", "must be true with grpo.async_grpo.enabled: the collector needs "
                                                 "requests that finish independently (vLLM's AsyncLLM)")
    in_flight = in_flight_section(config)
    if in_flight is not None and not vcfg["async_engine"]:
        raise ConfigError(f"{KEY}.async_engine", f"must be true with {in_flight}.in_flight_weight_updates: vLLM's "
                                                 "synchronous engine returns a batch whole, so a refit cannot land "
                                                 "in its requests")
    ep = vcfg["expert_parallel_size"]
    if ep not in (1, tp):
        raise ConfigError(f"{KEY}.expert_parallel_size",
                          f"{ep}: nrl runs vLLM's expert parallelism across one engine's tensor-parallel ranks, so "
                          f"it is 1 or tensor_parallel_size ({tp}); a larger size needs vLLM's data parallelism "
                          f"inside the engine, which nrl does not run")
    colocated = bool((generation.get("colocated") or {}).get("enabled"))
    if policy["refit"]["adapters"]:
        check_adapter_serving(vcfg, colocated=colocated)
    hf_config = local_model_config(config)
    if hf_config is None:
        return
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise ConfigError(f"{KEY}.tensor_parallel_size", f"{tp} does not divide the model's {heads} attention heads")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise ConfigError(f"{KEY}.tensor_parallel_size",
                          f"{tp} neither divides nor is a multiple of the model's {kv_heads} key/value heads")
    experts = next((getattr(hf_config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(hf_config, k, None)), None)
    if ep > 1 and not experts:
        raise ConfigError(f"{KEY}.expert_parallel_size", f"{ep} on a dense model: it has no experts to split; use 1")
    if ep > 1 and experts % ep:
        raise ConfigError(f"{KEY}.expert_parallel_size", f"{ep} does not divide the model's {experts} experts")
    limit = model_length_limit(hf_config, policy["tokenizer"]["name"] or policy["model_name"])
    if limit is not None and max_len > limit and not os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        raise ConfigError(length_key(config), f"{max_len} exceeds the model's maximum length {limit} (from its "
                                              f"config.json); vLLM refuses it, set at most {limit}")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def check_adapter_serving(vcfg: Mapping[str, Any], *, colocated: bool) -> None:
    """``policy.refit.adapters``: the engine keeps the base model and applies the adapters, so it
    must never drop its weights (sleep level 2 discards them, and a refit would only bring the
    adapters back)."""
    if vcfg["max_lora_rank"] not in LORA_RANKS:
        raise ConfigError(f"{KEY}.max_lora_rank", f"vLLM accepts one of {', '.join(map(str, LORA_RANKS))}, "
                                                  f"got {vcfg['max_lora_rank']}")
    if colocated and int(vcfg.get("sleep_level") or 1) == 2:
        raise ConfigError(f"{KEY}.sleep_level", "2 drops the engine's base weights, which adapter-only refit "
                                                "never sends again (policy.refit.adapters); use 1")


def model_length_limit(hf_config: Any, tokenizer_dir: str) -> int | None:
    """The longest sequence vLLM accepts for this model: the smallest length key of its config,
    capped by the tokenizer's ``model_max_length``, times the RoPE scaling factor for variants whose
    length key is the unscaled one. None when the config names no length."""
    lengths = [int(v) for v in (getattr(hf_config, k, None) for k in _LENGTH_KEYS) if isinstance(v, (int, float))]
    if not lengths:
        return None
    limit: float = min(lengths)
    tokenizer_config = Path(os.path.expanduser(tokenizer_dir)) / "tokenizer_config.json"
    try:
        model_max = json.loads(tokenizer_config.read_text()).get("model_max_length")
    except (OSError, ValueError):
        model_max = None
    if isinstance(model_max, (int, float)):
        limit = min(limit, model_max)
    factor = 1.0
    for params in _rope_parameters(hf_config):
        if params.get("rope_type", params.get("type")) not in _PRESCALED_ROPE and params.get("factor"):
            factor = float(params["factor"])
    return int(limit * factor)


def _rope_parameters(hf_config: Any) -> list[Mapping[str, Any]]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if not isinstance(params, Mapping):
        return []
    if all(isinstance(v, Mapping) for v in params.values()) and params:  # one entry per layer type
        return list(params.values())
    return [params]


_UNKNOWN_ARGUMENT = re.compile(r"unexpected keyword argument '([^']+)'")
_KV_NUMBERS = re.compile(r"\(([\d.]+) GiB KV cache is needed.*?memory \(([\d.]+) GiB\)")


def engine_start_error(exc: BaseException, config: Mapping[str, Any], *, cpu: bool) -> ConfigError | None:
    """The one-line error for a vLLM engine that refused to start because of a config value (its
    length limit, a KV cache that cannot hold one sequence, a cache dtype the host lacks kernels
    for, an engine argument vLLM does not know); None for any other failure."""
    text = str(exc)
    length = length_key(config)
    unknown = _UNKNOWN_ARGUMENT.search(text)
    if isinstance(exc, TypeError) and unknown:
        return ConfigError(f"policy.generation.vllm_kwargs.{unknown.group(1)}",
                           "vLLM's engine has no such argument; check the spelling against the installed vLLM")
    if "FP8 KV cache" in text:
        return ConfigError(f"{KEY}.kv_cache_dtype", f"{text.strip()} Use auto on this host")
    if "max_model_len" in text and "greater than the derived max_model_len" in text:
        return ConfigError(length, text.split(" To allow", 1)[0].strip())
    if "KV cache is needed" in text or "No available memory for the cache blocks" in text:
        if cpu:
            memory = ("VLLM_CPU_KVCACHE_SPACE (set in the environment)" if os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                      else f"{KEY}.kv_cache_space_gb")
        else:
            memory = f"{KEY}.gpu_memory_utilization"
        numbers = _KV_NUMBERS.search(text)
        amounts = f" ({numbers.group(1)} GiB needed, {numbers.group(2)} GiB available)" if numbers else ""
        return ConfigError(memory, f"the KV cache cannot hold one sequence of {length}"
                                   f"{amounts}; raise it or lower {length}")
    return None


def cpu_model_note(hf_config: Any) -> str | None:
    """What vLLM's CPU build computes differently for this model, as a warning line; None when
    nothing. gpt-oss's logprobs come out up to about 5e-3 from the trainer's there (measured on the
    tiny models, before and after a refit; other families' within 1e-3)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if getattr(text, "model_type", None) == "gpt_oss":
        return ("vLLM's CPU build computes gpt-oss's logprobs up to about 5e-3 from the trainer's (other models' "
                "within 1e-3); train/token_mult_prob_error shows it, and loss_fn.use_importance_sampling_correction "
                "corrects for it")
    return None


def check_cpu_engine_kwargs(vllm_kwargs: Mapping[str, Any] | None) -> None:
    """Engine arguments vLLM's CPU build cannot serve as nrl needs: speculative decoding, whose
    processed logprobs (the mode nrl runs vLLM in) come back NaN there for most sampled tokens
    (measured with ``deepseek_mtp`` on the tiny DeepSeek-V3: 80 to 90 of 128, against none without
    it, and none in raw-logprobs mode). GRPO reads them for its importance weights and its
    mismatch metrics."""
    if (vllm_kwargs or {}).get("speculative_config"):
        raise ConfigError("policy.generation.vllm_kwargs.speculative_config",
                          "vLLM's CPU build returns NaN logprobs for the tokens speculative decoding drafts, which "
                          "nrl reads; its engine needs a GPU, or remove speculative_config")
