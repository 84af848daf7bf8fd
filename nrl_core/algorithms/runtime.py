"""What one nrl command holds for its run: the plugin registries, and the worker groups it
launched before the run took them (:mod:`nrl_core.algorithms.policy_launch` says why it launches
early). The CLI makes one and passes it down, to the algorithm's entry and from there to the run,
its policy and its engines; nothing is parked in a module global to be fished out again, and
nothing below the algorithms reaches a global plugin manager (they are handed what they need).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import ray

from nrl_core.algorithms.policy_launch import (
    LaunchedGroup,
    LaunchedPolicy,
    colocated_generation,
    launch_generation,
    launch_policy,
)
from nrl_core.cluster import init_ray, shutdown_ray
from nrl_core.contracts import AlgorithmSpec, GenerationBackendSpec, TrainingBackendSpec
from nrl_core.plugins import PluginManager, get_plugin_manager
from nrl_core.timeline import mark

__all__ = ["Runtime", "call_with_runtime"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Runtime:
    """The registries and the groups launched early for one run."""

    plugins: PluginManager
    early_policy: LaunchedPolicy | None = None
    early_generation: LaunchedGroup | None = None

    @classmethod
    def for_process(cls) -> Runtime:
        """A run built in code (a test, a notebook): this process's plugins, nothing launched early."""
        return cls(get_plugin_manager())

    @contextlib.contextmanager
    def policy_launched_early(self, config: Mapping[str, Any], algorithm: AlgorithmSpec,
                              training: TrainingBackendSpec, generation: GenerationBackendSpec | None) -> Iterator[None]:
        """Within the block, the policy's worker group (and the generation group of engines that are
        not colocated) is launched and waiting to be taken by the run. On the way out a group nobody
        took (the config's last checks failed, or the run failed before it built it) is shut down,
        and so is the Ray this started when the policy was never taken, so a refused config leaves
        nothing running."""
        started_ray = not ray.is_initialized()
        init_ray(config["cluster"])
        launched = False
        colocated = colocated_generation(config, generates=algorithm.generates)
        try:
            self.early_policy = launch_policy(config, training, generation=generation, colocated=colocated,
                                              models_beside=len(algorithm.model_sections))
            launched = True
            mark("policy_launched")
            if algorithm.generates and generation is not None and not colocated:
                self.early_generation = launch_generation(config, generation, training)
                mark("generation_launched")
            yield
        finally:
            left, self.early_policy = self.early_policy, None
            left_generation, self.early_generation = self.early_generation, None
            for group in (left_generation, left):
                if group is not None:
                    group.discard()
            if started_ray and (left is not None or not launched):
                shutdown_ray()

    def start_generation_early(self, config: Mapping[str, Any]) -> None:
        """Build the engines launched early with the run's ``config`` (its checks passed) in the
        background, while the run builds its policy: engines that are not colocated need nothing
        from it until the first refit."""
        if self.early_generation is not None:
            self.early_generation.start_in_background({"config": dict(config)})

    def take_policy(self, training: TrainingBackendSpec, *, colocated: bool,
                    models_beside: int = 0) -> LaunchedPolicy | None:
        """The group launched early, if it is for ``training`` with the same colocation; one
        launched for something else is shut down (the run then launches its own)."""
        launched, self.early_policy = self.early_policy, None
        if launched is None:
            return None
        if (launched.group.worker_cls == training.worker and launched.colocated_generation == colocated
                and launched.models_beside == models_beside):
            return launched
        logger.warning("the policy workers started early do not match the run's (%s); starting new ones",
                       training.worker)
        launched.discard()
        return None

    def take_generation(self, generation: GenerationBackendSpec, config: Mapping[str, Any]) -> LaunchedGroup | None:
        """The generation group launched early, if it is for ``generation`` (and, when its engines
        are already building, with ``config``); one launched for something else is shut down."""
        launched, self.early_generation = self.early_generation, None
        if launched is None:
            return None
        if launched.group.worker_cls == generation.worker and launched.started_with in (None, {"config": dict(config)}):
            return launched
        logger.warning("the generation workers started early do not match the run's (%s); starting new ones",
                       generation.worker)
        launched.discard()
        return None


def call_with_runtime(function: Callable[..., Any], config: Mapping[str, Any], runtime: Runtime) -> Any:
    """``function(config, runtime=runtime)`` when it takes a ``runtime`` (the core's algorithm
    entries and runs do), else ``function(config)``: an algorithm written before the runtime still
    runs, launching its own workers instead of taking those started early."""
    try:
        takes = "runtime" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        takes = False
    return function(config, runtime=runtime) if takes else function(config)
