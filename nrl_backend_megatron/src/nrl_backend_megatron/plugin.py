"""nrl hook implementation of the Megatron backend: its registration.

Imports nothing heavy: the worker module (torch, megatron) is only named by its import path.
"""

from __future__ import annotations

from nrl_backend_megatron import commands
from nrl_backend_megatron.schema import MEGATRON_CFG_SCHEMA
from nrl_core.api import CommandSpec, TrainingBackendSpec, hookimpl

NRL_CONTRACT = 14  # the plugin contract this distribution is written for (docs/plugins.md)

WORKER_PATH = "nrl_backend_megatron.worker:MegatronPolicyWorker"


@hookimpl
def nrl_training_backends() -> list[TrainingBackendSpec]:
    return [TrainingBackendSpec(
        name="megatron", config_key="megatron_cfg", priority=20, worker=WORKER_PATH,
        config_schema=MEGATRON_CFG_SCHEMA, distribution="nrl-backend-megatron",
        parallel_size_keys=("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
        config_check="nrl_backend_megatron.checks:check_config",
        capabilities=frozenset({"data_parallel", "sequence_packing", "dynamic_batching", "adapter_export", "topk_logprobs",
                                "value_head", "skip_optimizer_state"}),
        memory_layout="nrl_backend_megatron.memory_layout:memory_layout",
        # Megatron's mixed-precision optimizer keeps CUDA tensors; the precision-aware one is
        # Transformer Engine's FusedAdam; the alltoall and flex MoE dispatchers use CUDA streams
        # (unset: allgather on a CPU, alltoall on GPUs), DeepEP's too. The distributed optimizer and
        # its overlaps, and sequence parallelism (norms.py), run on CPUs.
        twin={"optimizer.bf16": False, "optimizer.fp16": False, "optimizer.use_precision_aware_optimizer": False,
              "moe_token_dispatcher_type": None, "moe_enable_deepep": False},
        description="Megatron-Core: tensor/pipeline parallel training, dist_checkpointing",
    )]


@hookimpl
def nrl_commands() -> list[CommandSpec]:
    return commands.specs("nrl-backend-megatron")
