"""What a training backend tells ``nrl plan``: how it lays a model's state over its ranks.

A backend declares this through ``TrainingBackendSpec.memory_layout`` (an optional capability):
the core knows the model's sizes and the config's batch, the backend knows how it shards, in what
precision it keeps each piece and what its optimizer step allocates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateLayout:
    """One training rank's share of the model state, and what its step adds.

    ``*_shards`` divide a kind of state over ranks (1: every rank holds it whole). Bytes are per
    parameter as the rank keeps them. ``gathered_layers``: layers whose parameters a rank holds
    whole for a moment in the compute precision (FSDP's all-gather and its prefetch).
    ``optimizer_temporaries``: copies of the rank's optimizer shard the step allocates (torch's
    multi-tensor Adam builds its denominators as one; a fused Adam none). ``activation_shards``
    splits activations (tensor parallelism with sequence parallelism, context parallelism);
    ``logit_shards`` splits the vocabulary (tensor parallelism). ``pipeline_stages`` splits the
    layers, and the first stage keeps that many micro-batches in flight. ``reference_shards``
    further splits the reference policy's host copy of the rank's weights (data-parallel ranks
    that each keep only their range); ``gather_shards`` splits a gathered layer (tensor
    parallelism). ``adapter_rank``: LoRA of that rank trains adapters only, so gradients and
    optimizer state are the adapters'. ``offload``: parameters, gradients and optimizer state live
    in host memory.
    """

    param_shards: int = 1
    expert_shards: int = 1
    optimizer_shards: int = 1
    expert_optimizer_shards: int = 1
    param_bytes: int = 4
    grad_bytes: int = 4
    main_weight_bytes: int = 0
    optimizer_bytes: int = 8
    optimizer_temporaries: float = 0.0
    gathered_layers: int = 0
    activation_shards: int = 1
    logit_shards: int = 1
    pipeline_stages: int = 1
    compute_bytes: int = 4
    reference_shards: int = 1
    gather_shards: int = 1
    adapter_rank: int = 0
    recompute: bool = False
    offload: bool = False
