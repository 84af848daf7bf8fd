"""Where a worker group's actors run: Ray placement groups, shared or not.

A :class:`Placement` is a reservation (a Ray placement group), the bundles of it one group uses
(one bundle per rank) and the fraction of each bundle every actor asks for. The fraction is what
makes *colocation* work: training and generation workers that take turns on the same GPUs each
ask for half of every bundle, so Ray puts rank ``r`` of both groups on bundle ``r`` (the same GPU,
the same node) without either waiting for the other. Non-colocated groups get their own placement
group.

Bundles are ``{"CPU": cluster.cpus_per_worker}`` plus ``{"GPU": 1}`` when ``cluster.gpus_per_node``
is positive. The CPU figure is small by default (0.1): Ray only books it, processes are not
pinned, and on a small CPU-only machine a whole bundle per worker would leave groups waiting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nrl_core.cluster.nodes import NODE_ID_LABEL, cluster_summary, pick_nodes, release_nodes
from nrl_core.errors import NrlError

__all__ = ["Placement", "make_placement", "DEFAULT_CPUS_PER_WORKER"]

DEFAULT_CPUS_PER_WORKER = 0.1


@dataclass(frozen=True)
class Placement:
    """Bundles of one placement group that a worker group's ranks run on (rank ``r`` on
    ``bundle_indices[r]``), each actor asking for ``fraction`` of its bundle's resources.

    Groups built from the same reservation (:meth:`colocated`) share bundles; only the placement
    that created the reservation (``owner``) removes it.
    """

    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]
    bundle: Mapping[str, float]
    fraction: float = 1.0
    owner: bool = True
    nodes: tuple[str, ...] = ()  # the Ray nodes a multi-node placement holds (see nodes.py)

    @property
    def num_workers(self) -> int:
        return len(self.bundle_indices)

    @property
    def num_cpus_per_worker(self) -> float:
        return float(self.bundle.get("CPU", 0.0)) * self.fraction

    @property
    def num_gpus_per_worker(self) -> float:
        return float(self.bundle.get("GPU", 0.0)) * self.fraction

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray ``.options(...)`` that put rank ``rank`` on its bundle with its share of it."""
        return {
            "num_cpus": self.num_cpus_per_worker,
            "num_gpus": self.num_gpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.bundle_indices[rank],
                placement_group_capture_child_tasks=False,
            ),
        }

    def colocated(self, num_workers: int | None = None, fraction: float | None = None) -> Placement:
        """A placement on the same bundles (the first ``num_workers`` of them) for another group."""
        n = self.num_workers if num_workers is None else num_workers
        if not 0 < n <= self.num_workers:
            raise NrlError(
                f"cannot colocate {n} workers on a placement of {self.num_workers} bundles; "
                "use at most as many workers as the group it shares with"
            )
        return replace(
            self,
            bundle_indices=self.bundle_indices[:n],
            fraction=self.fraction if fraction is None else _check_fraction(fraction),
            owner=False,
        )

    def remove(self) -> None:
        """Release the reservation (owner only; a colocated view leaves it to the owner)."""
        if not self.owner:
            return
        release_nodes(self.nodes)
        if ray.is_initialized():
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # already removed, or Ray is going down: nothing left to release
                pass


def _check_fraction(fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise NrlError(f"a placement fraction must be in (0, 1], got {fraction}")
    return float(fraction)


def _gpu_workers(cluster_cfg: Mapping[str, Any]) -> int:
    """``cluster.gpus_per_node``, where Ray has GPUs. On a CPU-only cluster the same key counts
    the training workers per node, so one config runs on both."""
    gpus = int(cluster_cfg.get("gpus_per_node", 0) or 0)
    if gpus and ray.is_initialized() and not ray.cluster_resources().get("GPU"):
        return 0
    return gpus


def _bundle(cluster_cfg: Mapping[str, Any]) -> dict[str, float]:
    cpus = float(cluster_cfg.get("cpus_per_worker", DEFAULT_CPUS_PER_WORKER))
    gpus = _gpu_workers(cluster_cfg)
    if cpus <= 0 and gpus <= 0:
        raise NrlError("cluster.cpus_per_worker: must be positive on a machine without GPUs (e.g. 0.1)")
    bundle = {"CPU": cpus} if cpus > 0 else {}
    if gpus > 0:
        bundle["GPU"] = 1.0
    return bundle


def make_placement(
    cluster_cfg: Mapping[str, Any] | None,
    num_workers: int,
    *,
    name: str = "",
    colocate_with: Placement | None = None,
    max_colocated_groups: int = 1,
    strategy: str | None = None,
    timeout_s: float = 120.0,
    nodes: int | None = None,
) -> Placement:
    """Reserve bundles for ``num_workers`` ranks, or share ``colocate_with``'s.

    A fresh reservation sizes each actor's share as ``1 / max_colocated_groups`` of a bundle, so
    pass ``max_colocated_groups=2`` when a second group will join it through ``colocate_with``
    (which reuses the same bundles and share). ``strategy`` defaults to ``cluster.placement_strategy``
    or ``PACK`` (fill a node before the next). With GPUs, asking for more workers than
    ``cluster.num_nodes * cluster.gpus_per_node`` is a configuration error, reported before Ray
    would wait forever for GPUs that do not exist, and so is asking for more GPUs than the Ray
    cluster has. On a multi-node cluster (``cluster.num_nodes > 1``), ``nodes`` spreads the
    workers evenly over that many whole nodes that no other placement holds (:mod:`.nodes`).
    """
    if colocate_with is not None:
        return colocate_with.colocated(num_workers)
    cfg: Mapping[str, Any] = cluster_cfg or {}
    if num_workers < 1:
        raise NrlError(f"a placement needs at least one worker, got {num_workers}")
    bundle = _bundle(cfg)
    gpus_per_node = _gpu_workers(cfg)
    num_nodes = int(cfg.get("num_nodes", 1) or 1)
    if gpus_per_node > 0 and num_workers > gpus_per_node * num_nodes:
        raise NrlError(
            f"cluster: {num_workers} GPU workers do not fit on num_nodes={num_nodes} x "
            f"gpus_per_node={gpus_per_node}; lower the parallel sizes or add nodes"
        )
    have = float(ray.cluster_resources().get("GPU", 0)) if gpus_per_node > 0 else 0.0
    if gpus_per_node > 0 and num_workers > have:
        raise NrlError(f"cluster: {num_workers} GPU workers for '{name or 'workers'}' but the Ray cluster has "
                       f"{have:g} GPUs ({cluster_summary()}); lower the parallel sizes or add nodes")
    if max_colocated_groups < 1:
        raise NrlError(f"max_colocated_groups must be at least 1, got {max_colocated_groups}")
    strategy = strategy or str(cfg.get("placement_strategy", "PACK"))
    held: tuple[str, ...] = ()
    selectors = None
    if nodes is not None and num_nodes > 1:
        if nodes < 1 or num_workers % nodes:
            raise NrlError(f"cannot spread {num_workers} workers evenly over {nodes} nodes")
        per_node = num_workers // nodes
        held = tuple(pick_nodes(name, nodes, per_node, bundle))
        selectors = [{NODE_ID_LABEL: held[r // per_node]} for r in range(num_workers)]
    try:
        pg = placement_group([dict(bundle) for _ in range(num_workers)], strategy=strategy, name=name,
                             bundle_label_selector=selectors)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    except BaseException:
        release_nodes(held)
        raise
    if not ready:
        release_nodes(held)
        remove_placement_group(pg)
        raise NrlError(
            f"cluster: could not reserve {num_workers} bundles of {bundle} for '{name or 'workers'}' within "
            f"{timeout_s:.0f} s (Ray has {ray.available_resources()} free); lower cluster.cpus_per_worker, "
            "use fewer workers or add nodes"
        )
    return Placement(pg, tuple(range(num_workers)), bundle, 1.0 / max_colocated_groups, True, held)
