"""Which Ray nodes a multi-node role runs on: whole nodes, each role its own.

NeMo RL's multi-node semantics (see :mod:`nrl_core.config.topology`): training takes
``train_nodes`` whole nodes, non-colocated generation ``generation_nodes`` others, each with
``cluster.gpus_per_node`` workers. Ray's placement strategies cannot say "these nodes, not the
ones the other role has", so the driver picks the nodes itself and pins every bundle to its node
with the ``ray.io/node-id`` label; nodes a placement holds are remembered until it is removed, so
the next role gets other nodes.

A cluster that cannot host the request is a one-line :class:`~nrl_core.errors.NrlError` naming
what the cluster has, raised before Ray would wait for nodes that will never come.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

from nrl_core.errors import NrlError

__all__ = ["NODE_ID_LABEL", "pick_nodes", "release_nodes", "cluster_summary"]

NODE_ID_LABEL = "ray.io/node-id"
# node id -> the name of the placement holding it (this driver's placements only)
_HELD: dict[str, str] = {}


def _alive() -> list[dict[str, Any]]:
    """Alive nodes, the head first (users expect the first role on the node they started first)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (not n["Resources"].get("node:__internal_head__"), n["NodeID"]))


def cluster_summary(nodes: list[dict[str, Any]] | None = None) -> str:
    """``2 nodes: 5aab9c (CPU 2, GPU 0), 49fb08 (CPU 2, GPU 0)``, for error messages."""
    nodes = _alive() if nodes is None else nodes
    parts = [f"{n['NodeID'][:6]} (CPU {n['Resources'].get('CPU', 0):g}, GPU {n['Resources'].get('GPU', 0):g})"
             for n in nodes]
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {', '.join(parts) or 'none'}"


def _fits(node: Mapping[str, Any], bundle: Mapping[str, float], per_node: int) -> bool:
    return all(node["Resources"].get(key, 0.0) + 1e-9 >= amount * per_node for key, amount in bundle.items())


def pick_nodes(name: str, num_nodes: int, per_node: int, bundle: Mapping[str, float]) -> list[str]:
    """Ids of ``num_nodes`` alive nodes no other placement of this driver holds, each able to
    host ``per_node`` bundles; held for ``name`` until :func:`release_nodes`."""
    nodes = _alive()
    free = [n for n in nodes if n["NodeID"] not in _HELD and _fits(n, bundle, per_node)]
    if len(free) < num_nodes:
        held = [n["NodeID"] for n in nodes if n["NodeID"] in _HELD]
        taken = f"; {len(held)} held by {', '.join(sorted({_HELD[h] for h in held}))}" if held else ""
        raise NrlError(
            f"cluster: '{name or 'workers'}' needs {num_nodes} node(s) with {per_node} x {dict(bundle)} each, but the "
            f"Ray cluster has {cluster_summary(nodes)}{taken}; lower cluster.num_nodes or gpus_per_node, or add nodes")
    chosen = [n["NodeID"] for n in free[:num_nodes]]
    for node in chosen:
        _HELD[node] = name or "workers"
    return chosen


def release_nodes(node_ids: tuple[str, ...]) -> None:
    for node in node_ids:
        _HELD.pop(node, None)
