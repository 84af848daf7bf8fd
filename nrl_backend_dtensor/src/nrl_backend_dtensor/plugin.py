"""Registers the ``dtensor`` training backend with nrl.

The worker module (torch, transformers) is imported only when a worker exists, so loading this
plugin costs nothing beyond the schema.
"""

from __future__ import annotations

from nrl_backend_dtensor.schema import DTENSOR_CONFIG_SCHEMA
from nrl_core.api import TrainingBackendSpec, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

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
        config_check="nrl_backend_dtensor.checks:check_config",
        capabilities=frozenset({"data_parallel", "sequence_packing", "dynamic_batching", "adapter_export", "topk_logprobs",
                                "value_head", "skip_optimizer_state", "safetensors_checkpoints"}),
        memory_layout="nrl_backend_dtensor.memory_layout:memory_layout",
        description="PyTorch FSDP2 (fully_shard) with optional DTensor tensor parallelism",
    )]

