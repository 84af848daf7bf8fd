"""nrl hook implementations of the Megatron backend: registration and checkpoint dispatch.

Imports nothing heavy: the worker module (torch, megatron) is only named by its import path, and
the checkpoint hooks only import it when they are handed a worker.
"""

from __future__ import annotations

from typing import Any

from nrl_core.contracts import CheckpointOptions, TrainingBackendSpec
from nrl_core.hookspecs import hookimpl

from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA

WORKER_PATH = "nrl_backend_megatron.worker:MegatronPolicyWorker"


@hookimpl
def nrl_training_backends() -> list[TrainingBackendSpec]:
    return [TrainingBackendSpec(
        name="megatron", config_key="megatron_cfg", priority=20, worker=WORKER_PATH,
        config_schema=MEGATRON_CFG_SCHEMA, distribution="nrl-backend-megatron",
        parallel_size_keys=("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
        description="Megatron-Core: tensor/pipeline parallel training, dist_checkpointing",
    )]


def _is_ours(worker: Any) -> bool:
    # Compare by class path so a non-Megatron worker never triggers a megatron import.
    cls = type(worker)
    return f"{cls.__module__}:{cls.__qualname__}" == WORKER_PATH


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
