"""Configuration: load (YAML, ``defaults:``, overrides, ``${...}``), validate, select backends.

Names are imported lazily, so that importing the package costs nothing until a name is used. The
schema types live below it (:mod:`nrl_core.schema`), where the contracts can reach them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

_EXPORTS = {
    "REQUIRED": "schema", "Field": "schema", "Section": "schema",
    "apply_overrides": "loader", "deep_merge": "loader", "load_config": "loader", "resolve_interpolations": "loader",
    "value_at": "loader",
    "BackendChoice": "validate", "build_schema": "validate", "check_selected_backends": "validate",
    "choose_backends": "validate",
    "data_parallel_size": "validate", "select_training_backend": "validate", "validate_config": "validate",
}

__all__ = [*_EXPORTS, "load_and_validate"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nrl_core.config' has no attribute '{name}'")
    module = "nrl_core.schema" if _EXPORTS[name] == "schema" else f"nrl_core.config.{_EXPORTS[name]}"
    return getattr(importlib.import_module(module), name)


def load_and_validate(path: str, overrides: list[str] | tuple[str, ...], pm: PluginManager, *,
                      algorithm: str | None = None, backend_checks: bool = True) -> dict[str, Any]:
    """``load_config`` then ``validate_config`` against ``pm``'s plugins (checking ``algorithm``'s
    section, or those the file sets; ``backend_checks`` as there): the config every command uses."""
    from nrl_core.config.loader import load_config
    from nrl_core.config.validate import validate_config

    return validate_config(load_config(path, overrides), pm, algorithm=algorithm, backend_checks=backend_checks)
