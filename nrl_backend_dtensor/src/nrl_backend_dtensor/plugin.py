"""Registers the ``dtensor`` training backend and its checkpoint hooks with nrl.

The worker module (torch, transformers) is imported only when a worker exists, so loading this
plugin costs nothing beyond the schema.
"""

from __future__ import annotations

from typing import Any

from nrl_core.contracts import CheckpointOptions, TrainingBackendSpec
from nrl_core.hookspecs import hookimpl
from nrl_backend_dtensor.schema import DTENSOR_CONFIG_SCHEMA

WORKER_PATH = "nrl_backend_dtensor.worker:DTensorPolicyWorker"


@hookimpl
def nrl_training_backends() -> list[TrainingBackendSpec]:
    return [TrainingBackendSpec(
        name="dtensor",
        config_key="dtensor_config",
        config_aliases={"dtensor_cfg": "dtensor_config"},
        priority=10,
        worker=WORKER_PATH,
        config_schema=DTENSOR_CONFIG_SCHEMA,
        distribution="nrl-backend-dtensor",
        parallel_size_keys=("tensor_parallel_size", "context_parallel_size"),
        description="PyTorch FSDP2 (fully_shard) with optional DTensor tensor parallelism",
    )]


def _is_ours(worker: Any) -> bool:
    # Compare by class path, not isinstance: importing the worker module for a foreign worker
    # would pull in torch-heavy code needlessly.
    return any(f"{c.__module__}:{c.__qualname__}" == WORKER_PATH for c in type(worker).__mro__)


@hookimpl
def nrl_checkpoint_save(worker: Any, path: str, options: CheckpointOptions) -> bool | None:
    if not _is_ours(worker):
        return None
    worker.save_checkpoint(path, options)
    return True


@hookimpl
def nrl_checkpoint_load(worker: Any, path: str, options: CheckpointOptions) -> bool | None:
    if not _is_ours(worker):
        return None
    worker.load_checkpoint(path, options)
    return True
