"""The model's Hugging Face config, read without loading a model.

Config checks compare parallel sizes and lengths with the model (heads, layers, positions); the
answer is in the checkpoint's ``config.json``, which is cheap to read when ``policy.model_name`` is
a local directory. A hub id is left to the workers, which download it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from nrl_core.errors import ConfigError

__all__ = ["has_recurrent_layers", "local_model_config", "read_model_config"]


def read_model_config(model_dir: str, *, trust_remote_code: bool = False,
                      overrides: Mapping[str, Any] | None = None) -> Any:
    """``AutoConfig`` of the checkpoint directory ``model_dir`` with ``overrides``
    (``policy.hf_config_overrides``) applied; a one-line :class:`ConfigError` naming
    ``policy.model_name`` when there is no readable ``config.json``."""
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ConfigError("policy.model_name", f"'{model_dir}' has no config.json; it is not a Hugging Face checkpoint")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure to parse is the same user problem
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError("policy.model_name", f"cannot read the config in '{model_dir}': {reason}") from None
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def local_model_config(config: Mapping[str, Any]) -> Any | None:
    """:func:`read_model_config` for ``policy.model_name`` when it is a local directory, else None."""
    policy = config["policy"]
    model_dir = os.path.expanduser(str(policy["model_name"]))
    if not os.path.isdir(model_dir):
        return None
    return read_model_config(model_dir, trust_remote_code=bool(policy.get("trust_remote_code")),
                             overrides=policy.get("hf_config_overrides"))


def has_recurrent_layers(hf_config: Any) -> bool:
    """Whether the model has Mamba or linear-attention layers (Nemotron-H, Qwen3.5): layers whose
    state runs along the sequence, so engines must reset it where a sequence starts. It reads the
    config's per-layer kinds (``layers_block_type``, ``layer_types``) and Nemotron-H's
    ``hybrid_override_pattern``; a model that names its recurrent layers otherwise is not seen."""
    text = getattr(hf_config, "text_config", None) or hf_config
    kinds = [*(getattr(text, "layers_block_type", None) or []), *(getattr(text, "layer_types", None) or [])]
    pattern = str(getattr(text, "hybrid_override_pattern", None) or "")
    return any(kind in ("mamba", "linear_attention") for kind in kinds) or "M" in pattern
