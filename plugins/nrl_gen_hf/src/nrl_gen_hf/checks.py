"""What ``nrl config check`` asks of the hf backend (its spec's ``config_check``): the sampling
values transformers would refuse only once an engine generates, and a model it can build."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import ConfigError, local_model_config
from nrl_gen_hf.config import KEY


def check_config(config: Mapping[str, Any]) -> None:
    generation = config["policy"]["generation"]
    top_p = generation.get("top_p")
    if top_p is not None and not 0 < float(top_p) <= 1:
        raise ConfigError("policy.generation.top_p", f"must be in (0, 1], got {top_p}")
    hf_config = local_model_config(config)
    if hf_config is None:
        return
    limit = getattr(hf_config, "max_position_embeddings", None)
    total = config["policy"]["max_total_sequence_length"]
    if isinstance(limit, int) and total > limit:
        raise ConfigError("policy.max_total_sequence_length",
                          f"{total} exceeds the model's max_position_embeddings {limit} (its config.json); "
                          f"set at most {limit}")
    if (generation.get("hf_cfg") or {}).get("attn_implementation") == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ConfigError(f"{KEY}.attn_implementation",
                              "flash_attention_2 needs the flash-attn package, which is not installed; "
                              "use sdpa or null") from None
