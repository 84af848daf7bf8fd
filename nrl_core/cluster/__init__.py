"""Ray orchestration: start or join a cluster, place worker groups, run them, report failures.

``init_ray`` connects (local by default, an existing cluster through ``cluster.ray_address`` or
``RAY_ADDRESS``; ``cluster_failure`` says why a local one died under the run); ``make_placement``
reserves resources, shared by colocated groups; a ``WorkerGroup`` is N Ray actors forming one
``torch.distributed`` group around a backend's worker class, called as each method declares
(``dispatch``), whose failures arrive as ``WorkerError``s that name the rank.
"""

from nrl_core.cluster.gcs_watch import cluster_failure
from nrl_core.cluster.placement import Placement, make_placement
from nrl_core.cluster.ray_cluster import init_ray, shutdown_ray, worker_env_vars
from nrl_core.cluster.worker_group import (
    GroupRank,
    WorkerDiedError,
    WorkerFutures,
    WorkerGroup,
    WorkerInfo,
    WorkerRaisedError,
    WorkerTimeoutError,
)
from nrl_core.dispatch import Dispatch, Fanout, Gather, dispatch, dispatch_of
from nrl_core.errors import WorkerError

__all__ = [
    "Dispatch",
    "Fanout",
    "Gather",
    "GroupRank",
    "Placement",
    "WorkerDiedError",
    "WorkerError",
    "WorkerFutures",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerRaisedError",
    "WorkerTimeoutError",
    "cluster_failure",
    "dispatch",
    "dispatch_of",
    "init_ray",
    "make_placement",
    "shutdown_ray",
    "worker_env_vars",
]
