"""Creating the policy's training workers, and creating them early in ``nrl train``.

Before its first step a run has two long single-threaded stretches. The driver imports torch and
transformers, checks the config against the model and loads the data. Each policy worker imports
torch, its backend, transformers' model classes and, when generation is colocated, vLLM. Run one
after the other they add up; on a machine with a core to spare they overlap if the workers exist
first. So ``nrl train`` starts Ray and launches the policy's worker group right after the config's
schema pass (:func:`policy_launched_early`, for every algorithm): its actors import the worker
classes and the modules those name in ``lazy_imports`` while the driver does the rest, and the
run's :class:`~nrl_core.algorithms.policy.Policy` takes that group (:func:`take_early_policy`)
instead of launching its own; an algorithm that builds no policy leaves it to be stopped at the
end. This is the core's business, not a plugin's: no spec field asks for it (contract 5).
``benchmarks/bench_startup_overlap.py`` measures the overlap.

Nothing here imports torch: the launch happens before the driver does.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import ray

from nrl_core.cluster import WorkerGroup, init_ray, make_placement, shutdown_ray
from nrl_core.cluster.placement import Placement
from nrl_core.config.topology import cluster_topology
from nrl_core.contracts import LEGACY_PRELOAD, AlgorithmSpec, GenerationBackendSpec, TrainingBackendSpec
from nrl_core.process_groups import distributed_timeout_s
from nrl_core.timeline import mark

logger = logging.getLogger(__name__)

__all__ = ["LaunchedPolicy", "colocated_generation", "launch_policy", "policy_launched_early", "take_early_policy"]


@dataclass
class LaunchedPolicy:
    """A policy worker group whose actors exist and import, not yet started, with its placement."""

    group: WorkerGroup
    placement: Placement
    colocated_generation: bool

    def discard(self) -> None:
        self.group.shutdown()
        self.placement.remove()


def colocated_generation(config: Mapping[str, Any], *, generates: bool) -> bool:
    """Whether an algorithm that ``generates`` runs its engines inside the training workers."""
    generation = config["policy"]["generation"]
    return generates and generation is not None and bool(generation["colocated"]["enabled"])


def launch_policy(config: Mapping[str, Any], training: TrainingBackendSpec, *, colocated: bool,
                  generation: GenerationBackendSpec | None = None) -> LaunchedPolicy:
    """Place the training ranks of the cluster's topology and create their actors, which import
    ``training``'s modules (and, ``colocated``, ``generation``'s) at once; :meth:`WorkerGroup.start`
    builds the workers."""
    cluster = config["cluster"]
    topology = cluster_topology(config)
    placement = make_placement(cluster, topology.train_world, name="policy",
                               max_colocated_groups=2 if colocated else 1, nodes=topology.train_nodes)
    preload = _imports_of(training)
    if colocated and generation is not None:
        preload += _imports_of(generation)
    try:
        group = WorkerGroup(training.worker, topology.train_world, name=f"policy-{training.name}",
                            placement=placement, env_vars=dict(cluster.get("env_vars") or {}),
                            collective_timeout_s=distributed_timeout_s(config, training.config_key),
                            preload=preload, start=False)
    except BaseException:
        placement.remove()
        raise
    return LaunchedPolicy(group, placement, colocated)


def _imports_of(spec: TrainingBackendSpec | GenerationBackendSpec) -> list[str]:
    """What a worker process imports early for ``spec``: its worker class (and with it the
    modules the class names in ``lazy_imports``), and what a contract 1-4 spec named in ``preload``."""
    from nrl_core.contract_adapters import unwrap_path

    return [spec.worker, *LEGACY_PRELOAD.get(unwrap_path(spec.worker)[0], ())]


_early: LaunchedPolicy | None = None


@contextlib.contextmanager
def policy_launched_early(config: Mapping[str, Any], algorithm: AlgorithmSpec, training: TrainingBackendSpec,
                          generation: GenerationBackendSpec | None) -> Iterator[None]:
    """Within the block, the policy's worker group is launched and waiting to be taken by the
    run's ``Policy``. On the way out a group nobody took (the config's last checks failed, or the
    run failed before it built its policy) is shut down, and so is the Ray this started, so a
    refused config leaves nothing running."""
    global _early
    started_ray = not ray.is_initialized()
    init_ray(config["cluster"])
    launched = False
    try:
        _early = launch_policy(config, training, generation=generation,
                               colocated=colocated_generation(config, generates=algorithm.generates))
        launched = True
        mark("policy_launched")
        yield
    finally:
        left, _early = _early, None
        if left is not None:
            left.discard()
        if started_ray and (left is not None or not launched):
            shutdown_ray()


def take_early_policy(training: TrainingBackendSpec, *, colocated: bool) -> LaunchedPolicy | None:
    """The group :func:`policy_launched_early` launched, if it is for ``training`` with the same
    colocation; one launched for something else is shut down (the run then launches its own)."""
    global _early
    launched, _early = _early, None
    if launched is None:
        return None
    if launched.group.worker_cls == training.worker and launched.colocated_generation == colocated:
        return launched
    logger.warning("the policy workers started early do not match the run's (%s); starting new ones",
                   training.worker)
    launched.discard()
    return None
