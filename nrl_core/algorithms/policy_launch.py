"""Creating the policy's training workers, and creating them early in ``nrl train``.

Before its first step a run has two long single-threaded stretches. The driver imports torch and
transformers, checks the config against the model and loads the data. Each policy worker imports
torch, its backend, transformers' model classes and, when generation is colocated, vLLM. Run one
after the other they add up; on a machine with a core to spare they overlap if the workers exist
first. So ``nrl train`` starts Ray and launches the policy's worker group right after the config's
schema pass (:meth:`Runtime.policy_launched_early <nrl_core.algorithms.runtime.Runtime.policy_launched_early>`,
for every algorithm): its actors import the worker classes and the modules those name in
``lazy_imports`` while the driver does the rest, and the run's
:class:`~nrl_core.algorithms.policy.Policy` takes that group from the run's runtime instead of
launching its own; an algorithm that builds no policy leaves it to be stopped at the end. This
is the core's business, not a plugin's: no spec field asks for it (contract 5).
``benchmarks/bench_startup_overlap.py`` measures the overlap.

Engines that are not colocated get their own actors, launched early the same way right after the
policy's: they import vLLM while the driver checks the config, and once the checks pass they build
their engines (on a thread of the driver) while the policy's workers build, instead of after
them; the run's ``Generation`` takes them. The launched groups wait in the run's
:class:`~nrl_core.algorithms.runtime.Runtime`, never in a module global.

Nothing here imports torch: the launch happens before the driver does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nrl_core.algorithms.installed import cluster_topology
from nrl_core.cluster import WorkerGroup, make_placement
from nrl_core.cluster.placement import Placement
from nrl_core.contracts import LEGACY_PRELOAD, GenerationBackendSpec, TrainingBackendSpec
from nrl_core.generation_kit import in_flight_section
from nrl_core.process_groups import distributed_timeout_s

logger = logging.getLogger(__name__)

__all__ = ["LaunchedGroup", "LaunchedPolicy", "colocated_generation", "launch_beside", "launch_engines",
           "launch_generation", "launch_policy"]


@dataclass
class LaunchedGroup:
    """A worker group whose actors exist and import, not yet started, with its placement."""

    group: WorkerGroup
    placement: Placement
    started_with: dict[str, Any] | None = field(default=None, init=False)
    _starting: threading.Thread | None = field(default=None, init=False, repr=False)
    _start_error: BaseException | None = field(default=None, init=False, repr=False)

    def start_in_background(self, init_kwargs: dict[str, Any]) -> None:
        """Build the workers with ``init_kwargs`` on a thread of the driver, while it does other
        things; :meth:`finish_start` waits for them."""
        def start() -> None:
            try:
                self.group.start(init_kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised by finish_start
                self._start_error = exc

        self.started_with = init_kwargs
        self._starting = threading.Thread(target=start, name=f"nrl-start-{self.group.name}", daemon=True)
        self._starting.start()

    def finish_start(self, init_kwargs: dict[str, Any]) -> None:
        """Build the workers with ``init_kwargs``, or wait for the build already under way."""
        if self._starting is None:
            self.group.start(init_kwargs)
            return
        self._starting.join()
        if self._start_error is not None:
            raise self._start_error

    def discard(self) -> None:
        self.group.shutdown()
        if self._starting is not None:
            self._starting.join(timeout=60)  # its calls fail once the actors are gone
        self.placement.remove()


@dataclass
class LaunchedPolicy(LaunchedGroup):
    colocated_generation: bool
    models_beside: int = 0


def colocated_generation(config: Mapping[str, Any], *, generates: bool) -> bool:
    """Whether an algorithm that ``generates`` runs its engines inside the training workers."""
    generation = config["policy"]["generation"]
    return generates and generation is not None and bool(generation["colocated"]["enabled"])


def launch_policy(config: Mapping[str, Any], training: TrainingBackendSpec, *, colocated: bool,
                  generation: GenerationBackendSpec | None = None, models_beside: int = 0,
                  name: str = "policy") -> LaunchedPolicy:
    """Place the training ranks of the cluster's topology and create their actors, which import
    ``training``'s modules (and, ``colocated``, ``generation``'s) at once; :meth:`WorkerGroup.start`
    builds the workers. ``models_beside`` groups (an algorithm's ``model_sections``) will share
    the placement: each actor takes its share of a bundle accordingly."""
    cluster = config["cluster"]
    topology = cluster_topology(config)
    placement = make_placement(cluster, topology.train_world, name=name,
                               max_colocated_groups=(2 if colocated else 1) + models_beside, nodes=topology.train_nodes)
    preload = _imports_of(training)
    if colocated and generation is not None:
        preload += _imports_of(generation)
    try:
        group = WorkerGroup(training.worker, topology.train_world, name=f"{name}-{training.name}",
                            placement=placement, env_vars=dict(cluster.get("env_vars") or {}),
                            collective_timeout_s=distributed_timeout_s(config, training.config_key),
                            preload=preload, start=False, **_fault_owner(config, training))
    except BaseException:
        placement.remove()
        raise
    return LaunchedPolicy(group, placement, colocated, models_beside)


def launch_beside(config: Mapping[str, Any], training: TrainingBackendSpec, policy: Placement,
                  name: str) -> LaunchedPolicy:
    """The workers of a model beside the policy (:mod:`nrl_core.config.models`; ``config`` is its
    :func:`~nrl_core.config.models.model_config`) on ``policy``'s bundles, one rank per bundle."""
    topology = cluster_topology(config)
    placement = policy.colocated(topology.train_world)
    group = WorkerGroup(training.worker, topology.train_world, name=f"{name}-{training.name}", placement=placement,
                        env_vars=dict(config["cluster"].get("env_vars") or {}),
                        collective_timeout_s=distributed_timeout_s(config, training.config_key),
                        preload=_imports_of(training), start=False, **_fault_owner(config, training))
    return LaunchedPolicy(group, placement, False)


def launch_generation(config: Mapping[str, Any], generation: GenerationBackendSpec,
                      training: TrainingBackendSpec) -> LaunchedGroup:
    """The engines of the cluster's topology that are not colocated (:func:`launch_engines`)."""
    topology = cluster_topology(config)
    return launch_engines(config, generation, topology.generation_world, nodes=topology.generation_nodes,
                          collective_timeout_s=distributed_timeout_s(config, training.config_key))


def launch_engines(config: Mapping[str, Any], generation: GenerationBackendSpec, world: int, *,
                   collective_timeout_s: float, nodes: int | None = None, name: str = "generation") -> LaunchedGroup:
    """Place ``world`` ranks of ``generation``'s engines in actors of their own and create them;
    they import ``generation``'s modules at once, and :meth:`LaunchedGroup.finish_start` builds
    the engines. With in-flight weight updates their hosts get a thread for imports beside the
    stream."""
    cluster = config["cluster"]
    engine_size = generation.engine_size(config["policy"]["generation"].get(generation.config_key) or {})
    placement = make_placement(cluster, world, name=name, nodes=nodes)
    try:
        # engines of one rank are independent processes; only a multi-rank engine needs a group
        group = WorkerGroup(generation.worker, world, name=f"{name}-{generation.name}",
                            placement=placement, env_vars=dict(cluster.get("env_vars") or {}),
                            distributed_backend="auto" if engine_size > 1 else "none",
                            collective_timeout_s=collective_timeout_s, preload=_imports_of(generation), start=False,
                            in_flight=in_flight_section(config) is not None, **_fault_owner(config, generation))
    except BaseException:
        placement.remove()
        raise
    return LaunchedGroup(group, placement)


def _fault_owner(config: Mapping[str, Any], spec: TrainingBackendSpec | GenerationBackendSpec) -> dict[str, Any]:
    """A worker group's ``owner`` and ``fault_log_dir``: what a plugin's worker raises is that
    plugin's fault, one line naming it (:mod:`nrl_core.plugin_faults`). A spec no registry holds
    (built in code) has no owner, and its workers' errors keep their traceback."""
    from nrl_core.plugins import get_plugin_manager

    plugins = get_plugin_manager()
    registry = plugins.training_backends() if isinstance(spec, TrainingBackendSpec) else plugins.generation_backends()
    if spec.name not in registry or registry.get(spec.name, "").worker != spec.worker:
        return {}
    return {"owner": registry.plugin_owner(spec.name), "fault_log_dir": (config.get("logger") or {}).get("log_dir")}


def _imports_of(spec: TrainingBackendSpec | GenerationBackendSpec) -> list[str]:
    """What a worker process imports early for ``spec``: its worker class (and with it the
    modules the class names in ``lazy_imports``), and what a contract 1-4 spec named in ``preload``."""
    from nrl_core.contract_versions import unwrap_path

    return [spec.worker, *LEGACY_PRELOAD.get(unwrap_path(spec.worker)[0], ())]
