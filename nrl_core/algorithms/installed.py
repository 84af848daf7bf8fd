"""The public API's config and data entry points, as a plugin or a notebook calls them: with the
plugins installed in this process unless the caller passes a run's own. Below the algorithms the
same functions take the registries as a required argument (the CLI hands each run its
:class:`~nrl_core.algorithms.runtime.Runtime`); this is the one place a default stands in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nrl_core import config as _config
from nrl_core.config import checks as _checks
from nrl_core.config import topology as _topology
from nrl_core.config.validate import BackendChoice
from nrl_core.contracts import TrainingBackendSpec
from nrl_core.data import processors as _processors
from nrl_core.plugins import PluginManager, get_plugin_manager

__all__ = ["choose_backends", "cluster_topology", "data_parallel_size", "load_and_validate", "prepare_data",
           "validate_config"]


def _installed(pm: PluginManager | None) -> PluginManager:
    return pm if pm is not None else get_plugin_manager()


def validate_config(raw: Mapping[str, Any], pm: PluginManager | None = None, *, algorithm: str | None = None,
                    backend_checks: bool = True) -> dict[str, Any]:
    """:func:`nrl_core.config.validate.validate_config`: ``raw`` checked and completed."""
    from nrl_core.config.validate import validate_config as validate

    return validate(raw, _installed(pm), algorithm=algorithm, backend_checks=backend_checks)


def load_and_validate(path: str, overrides: Sequence[str] = (), pm: PluginManager | None = None, *,
                      algorithm: str | None = None, backend_checks: bool = True) -> dict[str, Any]:
    """:func:`nrl_core.config.load_and_validate`: the file at ``path`` with ``overrides``, validated."""
    return _config.load_and_validate(path, tuple(overrides), _installed(pm), algorithm=algorithm,
                                     backend_checks=backend_checks)


def choose_backends(config: Mapping[str, Any], pm: PluginManager | None = None, *, generation: bool = True,
                    warn: bool = True) -> BackendChoice:
    """:func:`nrl_core.config.validate.choose_backends`: the training and generation backends a config selects."""
    return _config.choose_backends(config, _installed(pm), generation=generation, warn=warn)


def cluster_topology(config: Mapping[str, Any], pm: PluginManager | None = None) -> _topology.Topology:
    """:func:`nrl_core.config.topology.cluster_topology`: where a config's ranks go."""
    return _topology.cluster_topology(config, _installed(pm))


def data_parallel_size(config: Mapping[str, Any], spec: TrainingBackendSpec | None,
                       pm: PluginManager | None = None) -> int:
    """:func:`nrl_core.config.checks.data_parallel_size`: model replicas among the training ranks."""
    return _checks.data_parallel_size(config, spec, _installed(pm))


def prepare_data(data_cfg: Mapping[str, Any], tokenizer: Any, pm: PluginManager | None = None, *,
                 processor: str | None = None, limits: _processors.LengthLimits | None = None
                 ) -> _processors.PreparedData:
    """:func:`nrl_core.data.processors.prepare_data`: the records of a ``data`` section, processed."""
    return _processors.prepare_data(data_cfg, tokenizer, _installed(pm), processor=processor, limits=limits)
