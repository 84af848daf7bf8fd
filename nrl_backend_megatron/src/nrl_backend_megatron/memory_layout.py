"""How this backend lays a model's state over its ranks, for ``nrl plan``.

Megatron splits the weights over tensor and pipeline ranks (routed experts over expert and
pipeline ranks) and keeps every data-parallel replica whole; its distributed optimizer also
splits the fp32 main weights and Adam's state over the data-parallel ranks, and the reference
policy's host copy with them (``reference.py``). Gradients live in
DDP's buffer (float32 with ``grad_reduce_in_fp32`` or a float32 model). The vocabulary-parallel
output layer splits the logits over tensor ranks. Adam allocates no copy of its state: on GPUs it
is Transformer Engine's fused Adam (NeMo RL's images ship TE; without it torch's multi-tensor Adam
would add one copy of the optimized shard, which this does not count), on the CPU torch's, one
tensor at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nrl_core.api import StateLayout


def memory_layout(policy: Mapping[str, Any], world_size: int, device: str) -> StateLayout:
    section = policy.get("megatron_cfg") or {}
    tp = int(section.get("tensor_model_parallel_size") or 1)
    pp = int(section.get("pipeline_model_parallel_size") or 1)
    cp = int(section.get("context_parallel_size") or 1)
    ep = int(section.get("expert_model_parallel_size") or 1)
    dp = max(world_size // (tp * pp * cp), 1)
    expert_dp = max(world_size // (ep * pp), 1)
    optimizer = section.get("optimizer") or {}
    peft = section.get("peft") or {}
    distributed = bool(optimizer.get("use_distributed_optimizer"))
    precision = str(policy.get("precision") or ("float32" if device == "cpu" else "bfloat16"))  # as the worker resolves it
    mixed = precision != "float32" or bool(optimizer.get("bf16") or optimizer.get("fp16"))
    param_bytes = 2 if mixed else 4
    ddp = section.get("distributed_data_parallel_config") or {}
    recompute = bool(section.get("activation_checkpointing")) and section.get("recompute_granularity") == "full"
    return StateLayout(
        param_shards=tp * pp, expert_shards=ep * pp,
        optimizer_shards=tp * pp * (dp * cp if distributed else 1),
        expert_optimizer_shards=ep * pp * (expert_dp if distributed else 1),
        param_bytes=param_bytes, grad_bytes=4 if not mixed or ddp.get("grad_reduce_in_fp32") else 2,
        main_weight_bytes=4 if mixed else 0, optimizer_bytes=8,
        compute_bytes=param_bytes, activation_shards=(tp if section.get("sequence_parallel") else 1) * cp,
        logit_shards=tp, pipeline_stages=pp, reference_shards=dp * cp if distributed else 1, recompute=recompute,
        adapter_rank=int(peft.get("dim") or 8) if peft.get("enabled") else 0)
