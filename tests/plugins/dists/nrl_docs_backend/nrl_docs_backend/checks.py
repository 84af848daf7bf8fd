"""The docs backend's own config rules: what the schema cannot judge, checked before any worker is built."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.contracts import import_object
from nrl_core.errors import ConfigError, PluginError


def optimizer_class(name: str) -> type:
    """``policy.optimizer.name`` (``"torch.optim.AdamW"``) as a class, or a one-line ConfigError."""
    import torch

    path = name if ":" in name else ":".join(name.rsplit(".", 1))
    try:
        cls = import_object(path)
    except PluginError as exc:
        raise ConfigError("policy.optimizer.name", f"cannot import '{name}': {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError("policy.optimizer.name", f"'{name}' is not a torch.optim.Optimizer subclass")
    return cls


def check_config(config: Mapping[str, Any]) -> None:
    policy = config["policy"]
    if policy.get("optimizer") is None:
        raise ConfigError("policy.optimizer", "the docs backend needs an optimizer; set policy.optimizer.name "
                                              "(e.g. torch.optim.AdamW)")
    optimizer_class(policy["optimizer"]["name"])
    if policy.get("scheduler"):
        raise ConfigError("policy.scheduler", "the docs backend has no LR schedulers; remove policy.scheduler "
                                              "or use the dtensor backend")
