"""How this backend lays a model's state over its ranks, for ``nrl plan``.

FSDP2 shards parameters, gradients and AdamW's state over the data-parallel ranks, and tensor
parallelism splits them further; parameters are kept in float32 and gathered a layer at a time
(with the next one prefetched) in the compute precision. On CUDA, torch's AdamW is its
multi-tensor one, which allocates one float32 copy of the rank's shard for its denominators; on
the CPU it steps one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import StateLayout


def memory_layout(policy: Mapping[str, Any], world_size: int, device: str) -> StateLayout:
    section = policy.get("dtensor_config") or {}
    tp = int(section.get("tensor_parallel_size") or 1)
    cp = int(section.get("context_parallel_size") or 1)
    dp = max(world_size // (tp * cp), 1)
    precision = str(policy.get("precision") or ("float32" if device == "cpu" else "bfloat16"))  # as the worker resolves it
    compute = 4 if precision == "float32" else 2
    offload = bool(section.get("cpu_offload"))
    shards = dp * tp
    lora = section.get("lora_cfg") or {}
    return StateLayout(
        param_shards=shards, expert_shards=shards, optimizer_shards=shards, expert_optimizer_shards=shards,
        param_bytes=4, grad_bytes=4, optimizer_bytes=8, optimizer_temporaries=1.0 if device == "cuda" else 0.0,
        gathered_layers=2 if dp > 1 else 0, gather_shards=tp, compute_bytes=compute,
        adapter_rank=int(lora.get("dim") or 8) if lora.get("enabled") else 0,
        activation_shards=(tp if section.get("sequence_parallel") else 1) * cp,
        recompute=bool(section.get("activation_checkpointing")), offload=offload)
