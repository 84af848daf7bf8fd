"""How many workers each role gets, from ``cluster`` and ``policy.generation.colocated``.

NeMo RL's semantics, so its configs mean the same here: ``cluster.gpus_per_node x num_nodes`` is
the whole cluster. Colocated generation shares the training workers' devices (one engine per
``engine_size`` training ranks, inside their actors). Non-colocated generation takes devices from
the cluster: on one node ``colocated.resources.gpus_per_node`` of its devices, on several nodes
``colocated.resources.num_nodes`` whole nodes; training gets the rest. An environment with workers
of its own (a reward model: ``EnvironmentSpec.resources_key``) takes its devices first, the same way.

On a machine without GPUs a "GPU" is a worker process, so one config runs on both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nrl_core.errors import ConfigError

if TYPE_CHECKING:
    from nrl_core.plugins import PluginManager

_RESOURCES = "policy.generation.colocated.resources"


@dataclass(frozen=True)
class Topology:
    """Workers per role. ``generation_*`` describe non-colocated generation's own devices; a
    colocated engine lives in the training actors, so those are 0 then."""

    train_nodes: int
    train_per_node: int
    colocated: bool
    generation_nodes: int = 0
    generation_per_node: int = 0
    engine_size: int = 1

    @property
    def train_world(self) -> int:
        return self.train_nodes * self.train_per_node

    @property
    def generation_world(self) -> int:
        """Ranks that host generation: the training ranks when colocated."""
        return self.train_world if self.colocated else self.generation_nodes * self.generation_per_node

    @property
    def num_engines(self) -> int:
        return self.generation_world // self.engine_size

    @property
    def total_nodes(self) -> int:
        return self.train_nodes + self.generation_nodes


def cluster_topology(config: Mapping[str, Any], pm: PluginManager) -> Topology:
    """The topology of a validated ``config``, an engine spanning the selected generation
    backend's parallel sizes (``GenerationBackendSpec.engine_size``) among ``pm``'s."""
    generation = config["policy"]["generation"]
    engine_size, engine_key = 1, "policy.generation"
    if generation is not None:
        registry = pm.generation_backends()
        if generation["backend"] in registry:
            spec = registry.get(generation["backend"], "policy.generation.backend")
            section = generation.get(spec.config_key) or {}
            engine_size = spec.engine_size(section)
            larger = [key for key in spec.parallel_size_keys if int(section.get(key) or 1) > 1]
            engine_key = f"policy.generation.{spec.config_key}" + (f".{larger[0]}" if len(larger) == 1 else "")
    return topology(config, engine_size, engine_key, environment=environment_devices(config, pm))


def environment_devices(config: Mapping[str, Any], pm: PluginManager) -> tuple[str, int, int] | None:
    """``(key, gpus_per_node, num_nodes)`` the run's environment takes from the cluster
    (``EnvironmentSpec.resources_key``, contract 11), or None."""
    name = (config.get("data") or {}).get("env_name")
    registry = pm.environments()
    if not name or name not in registry:
        return None
    key = getattr(registry.get(name, "data.env_name"), "resources_key", None)
    resources = ((config.get("env") or {}).get(name) or {}).get(key) if key else None
    if not resources:
        return None
    return f"env.{name}.{key}", int(resources.get("gpus_per_node") or 0), int(resources.get("num_nodes") or 1)


def topology(config: Mapping[str, Any], engine_size: int = 1, engine_key: str = "policy.generation", *,
             environment: tuple[str, int, int] | None = None) -> Topology:
    """The topology ``config`` asks for; ``engine_size`` is the ranks one generation engine spans
    (its backend's parallel sizes). A split that leaves a role without workers, or engines that do
    not tile the generation ranks, is a :class:`ConfigError` naming the key to change."""
    cluster = config["cluster"]
    per_node, nodes = int(cluster["gpus_per_node"]), int(cluster["num_nodes"])
    for key, value in (("gpus_per_node", per_node), ("num_nodes", nodes)):
        if value <= 0:
            raise ConfigError(f"cluster.{key}", f"must be positive, got {value}")
    if environment is not None:
        per_node, nodes = _after_environment(environment, per_node, nodes)
    generation = (config.get("policy") or {}).get("generation")
    if generation is None or generation["colocated"]["enabled"]:
        result = Topology(train_nodes=nodes, train_per_node=per_node, colocated=True, engine_size=engine_size)
        if generation is not None:
            hosts = f"the {result.train_world} training workers that host the engines (cluster.gpus_per_node x num_nodes)"
            _check_engines(result, engine_key, hosts)
        return result
    resources = generation["colocated"]["resources"]
    gen_per_node, gen_nodes = resources.get("gpus_per_node"), resources.get("num_nodes")
    if nodes == 1:
        if not gen_per_node or gen_per_node <= 0:
            raise ConfigError(f"{_RESOURCES}.gpus_per_node",
                              "must be set to the devices generation takes from the node when generation is not "
                              "colocated (training gets cluster.gpus_per_node minus these)")
        if gen_nodes not in (None, 1):
            raise ConfigError(f"{_RESOURCES}.num_nodes", f"must be 1 or null on a one-node cluster, got {gen_nodes}")
        if gen_per_node >= per_node:
            raise ConfigError(f"{_RESOURCES}.gpus_per_node",
                              f"{gen_per_node} leaves no training workers of cluster.gpus_per_node={per_node}; "
                              "raise cluster.gpus_per_node or give generation fewer")
        result = Topology(train_nodes=1, train_per_node=per_node - gen_per_node, colocated=False,
                          generation_nodes=1, generation_per_node=int(gen_per_node), engine_size=engine_size)
    else:
        if not gen_nodes or gen_nodes <= 0:
            raise ConfigError(f"{_RESOURCES}.num_nodes",
                              "must be set to the nodes generation takes when generation is not colocated on a "
                              "multi-node cluster (training gets the other nodes)")
        if gen_per_node not in (None, per_node):
            raise ConfigError(f"{_RESOURCES}.gpus_per_node",
                              f"must equal cluster.gpus_per_node ({per_node}) or be null on a multi-node cluster "
                              f"(generation takes whole nodes), got {gen_per_node}")
        if gen_nodes >= nodes:
            raise ConfigError(f"{_RESOURCES}.num_nodes",
                              f"{gen_nodes} leaves no training nodes of cluster.num_nodes={nodes}")
        result = Topology(train_nodes=nodes - gen_nodes, train_per_node=per_node, colocated=False,
                          generation_nodes=int(gen_nodes), generation_per_node=per_node, engine_size=engine_size)
    _check_engines(result, engine_key, f"the {result.generation_world} generation workers ({_RESOURCES})")
    return result


def _after_environment(environment: tuple[str, int, int], per_node: int, nodes: int) -> tuple[int, int]:
    """The cluster left once the environment took its devices: on one node ``gpus_per_node`` of
    them, on several ``num_nodes`` whole nodes (NeMo RL's split)."""
    key, env_per_node, env_nodes = environment
    if nodes == 1:
        if env_per_node >= per_node:
            raise ConfigError(f"{key}.gpus_per_node", f"{env_per_node} leaves nothing of cluster.gpus_per_node="
                                                      f"{per_node} for training and generation; raise "
                                                      "cluster.gpus_per_node or give the environment fewer")
        return per_node - env_per_node, 1
    if env_nodes >= nodes:
        raise ConfigError(f"{key}.num_nodes", f"{env_nodes} leaves no nodes of cluster.num_nodes={nodes} for "
                                              "training and generation")
    return per_node, nodes - env_nodes


def _check_engines(result: Topology, key: str, what: str) -> None:
    if result.engine_size <= 0 or result.generation_world % result.engine_size:
        raise ConfigError(key, f"an engine spans {result.engine_size} ranks, which does not divide {what}")
