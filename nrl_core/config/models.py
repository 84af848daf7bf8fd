"""Models an algorithm runs beside the policy (distillation's teacher): sections shaped like
``policy``, named by ``AlgorithmSpec.model_sections`` (contract 10).

Such a section is validated with the ``policy`` schema, its training backend chosen and checked as
the policy's is, and its workers are placed on the policy's devices. A run builds it from
:func:`model_config`: the whole config with ``policy`` replaced by the section, except that
``policy.generation`` stays the policy's, since the generation layout decides which devices the
training ranks (and so the model beside them) get.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from nrl_core.errors import ConfigError

__all__ = ["model_config", "model_section_owners", "renamed_error"]


def model_section_owners(pm: Any) -> dict[str, str]:
    """Model section -> the installed algorithm that declares it."""
    owners: dict[str, str] = {}
    for spec in pm.algorithms():
        for section in spec.model_sections:
            if section in owners and owners[section] != spec.name:
                raise ConfigError(section, f"is a model section of both '{owners[section]}' and '{spec.name}'; "
                                           "uninstall one of the two plugins")
            owners[section] = spec.name
    return owners


def model_config(config: Mapping[str, Any], section: str, policy: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config`` with ``policy`` replaced by the model section ``section`` (or by ``policy``), keeping
    the policy's ``generation`` and, where the section sets none, its seed."""
    model = dict(config)
    replacement = copy.deepcopy(dict(policy if policy is not None else config[section]))
    replacement["generation"] = config["policy"]["generation"]
    if replacement.get("seed") is None:
        replacement["seed"] = config["policy"].get("seed")
    model["policy"] = replacement
    return model


def renamed_error(error: ConfigError, section: str) -> ConfigError:
    """``error`` about the model's ``policy.<key>`` as one about ``<section>.<key>``."""
    path = error.key_path
    if path == "policy" or path.startswith("policy."):
        path = section + path[len("policy"):]
    return ConfigError(path, error.message)
