"""Peak memory per device, per role, predicted from a config and its model's HF config alone.

Why: a config that cannot fit is otherwise found after minutes of start-up, as an out-of-memory
error deep inside a worker. The prediction counts what each rank holds (parameters, gradients,
optimizer state, in the precision and sharding its backend declares in a :class:`StateLayout`),
what its step adds (activations of one micro-batch, logits, gathered layers, optimizer
temporaries), the generation engine's weights and KV cache, and the colocated hand-off's worst
moment. The constants below were fixed before the measurements in docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nrl_core.plan.layout import StateLayout
from nrl_core.plan.model_shape import ModelShape

GiB = 2**30

#: Activation elements one token keeps per decoder layer for the backward, in units of the
#: hidden width and of the MLP width it passes through: norms, projections, rotary q/k, attention
#: output and residuals (about 12 hidden-wide tensors), and the gated MLP's gate, up, activation
#: and product (4 MLP-wide ones). Attention scores are not kept (flash or memory-efficient kernels).
ACTIVATION_HIDDEN_COPIES = 12
ACTIVATION_MLP_COPIES = 4
#: float32 logits of one micro-batch, their log-softmax and its gradient.
LOGIT_COPIES = 3
#: Bytes per element of the KV cache by ``kv_cache_dtype`` (``auto``: the engine's dtype).
KV_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class Line:
    """One thing a device (or the host, for ``where == "host"``) holds at the role's peak."""

    what: str
    bytes: int
    where: str = "device"


@dataclass(frozen=True)
class RolePlan:
    """The predicted peak of one role's busiest device, with what makes it up."""

    role: str
    placement: str
    lines: tuple[Line, ...]
    note: str = ""
    knob: str = ""

    @property
    def device_bytes(self) -> int:
        return sum(line.bytes for line in self.lines if line.where == "device")

    @property
    def host_bytes(self) -> int:
        return sum(line.bytes for line in self.lines if line.where == "host")


@dataclass(frozen=True)
class TrainingRole:
    """A role that runs a training backend's worker: what it does and on which batch."""

    role: str
    layout: StateLayout
    trains: bool
    micro_tokens: int
    reference: bool = False
    placement: str = ""
    advice: str = ""


def training_plan(shape: ModelShape, role: TrainingRole) -> RolePlan:
    """The busiest rank of a training role at the peak of its step (or its scoring pass)."""
    lay = role.layout
    dense, experts = shape.dense_params, shape.layers * shape.expert_params
    params = dense / lay.param_shards + experts / lay.expert_shards
    optimized = dense / lay.optimizer_shards + experts / lay.expert_optimizer_shards
    state = "host" if lay.offload else "device"
    lines = [Line("weights", int(params * lay.param_bytes), state)]
    if lay.adapter_rank:  # LoRA: the adapters alone train, each rank holding them whole
        params = optimized = shape.adapter_params(lay.adapter_rank)
        lines.append(Line(f"LoRA adapters (rank {lay.adapter_rank})", int(params * lay.param_bytes), state))
    if role.trains:
        lines.append(Line("gradients", int(params * lay.grad_bytes), state))
        if lay.main_weight_bytes:
            lines.append(Line("fp32 main weights", int(optimized * lay.main_weight_bytes), state))
        lines.append(Line("optimizer state", int(optimized * lay.optimizer_bytes), state))
        if lay.optimizer_temporaries:
            lines.append(Line("optimizer step temporaries", int(optimized * 4 * lay.optimizer_temporaries), state))
    if lay.gathered_layers:  # FSDP gathers a layer whole over its data-parallel ranks, experts included
        layer = (shape.layer_params + shape.expert_params) / lay.gather_shards
        lines.append(Line("gathered layers", int(lay.gathered_layers * layer * lay.compute_bytes)))
    lines.append(Line("activations", activation_bytes(shape, role)))
    lines.append(Line("logits", int(role.micro_tokens * shape.vocab / lay.logit_shards * 4 * LOGIT_COPIES)))
    if role.reference and not lay.adapter_rank:  # with LoRA the reference is the base model itself
        lines.append(Line("reference weights (host copy of own shards)",
                          int(params * lay.param_bytes / lay.reference_shards), "host"))
    return RolePlan(role.role, role.placement, tuple(lines), knob=role.advice)


def activation_bytes(shape: ModelShape, role: TrainingRole) -> int:
    """One micro-batch's activations on the first pipeline stage (the one holding the most)."""
    lay = role.layout
    layers = -(-shape.layers // lay.pipeline_stages)
    per_layer = (ACTIVATION_HIDDEN_COPIES * shape.hidden + ACTIVATION_MLP_COPIES * shape.active_mlp_width)
    per_layer = per_layer * role.micro_tokens * lay.compute_bytes / lay.activation_shards
    if not role.trains:  # scoring keeps nothing for a backward: one layer at a time
        return int(per_layer)
    if lay.recompute:  # each layer's input, and one layer recomputed in full
        kept = layers * role.micro_tokens * shape.hidden * lay.compute_bytes / lay.activation_shards + per_layer
    else:
        kept = layers * per_layer
    return int(kept * lay.pipeline_stages)


@dataclass(frozen=True)
class EngineRole:
    """A generation engine: its tensor-parallel size, dtype, memory fraction and context."""

    tensor_parallel: int
    weight_bytes: int
    kv_bytes: int
    memory_fraction: float
    max_model_len: int
    placement: str = ""


def engine_plan(shape: ModelShape, engine: EngineRole, device_memory: int | None) -> RolePlan:
    """An engine rank: its weight shard and the KV cache it sizes to fill its memory fraction (at
    least one sequence of the full context, which it needs to start)."""
    weights = int(shape.total_params * engine.weight_bytes / engine.tensor_parallel)
    per_token = shape.kv_elements_per_token * engine.kv_bytes / engine.tensor_parallel
    least = int(per_token * engine.max_model_len)
    lines = [Line("engine weights", weights)]
    if device_memory is None:
        lines.append(Line("KV cache, one full-length sequence (the engine fills its fraction)", least))
        note = f"the engine takes {engine.memory_fraction:g} of each device"
    else:
        cache = max(int(engine.memory_fraction * device_memory) - weights, 0)
        lines.append(Line(f"KV cache ({engine.memory_fraction:g} of the device less the weights)", max(cache, least)))
        note = f"{cache / (per_token or 1):.0f} tokens of KV cache" if per_token else ""
    return RolePlan("generation engine", engine.placement, tuple(lines), note=note,
                    knob="raise policy.generation.vllm_cfg.tensor_parallel_size")


def colocated_plan(training: RolePlan, engine: RolePlan, *, offload_weights: bool) -> RolePlan:
    """The worst moment of a device that trains and generates: the refit (training weights, the
    engine's weights, and the whole model the in-process transfer stages before it loads) or
    generation (the engine, and the training weights when they stay)."""
    weights = next((line.bytes for line in training.lines if line.what == "weights" and line.where == "device"), 0)
    engine_weights = next(line.bytes for line in engine.lines if line.what == "engine weights")
    refit = (Line("training weights", weights), Line("engine weights", engine_weights),
             Line("refit staging (whole model)", engine_weights))
    generating = (*engine.lines, *((Line("training weights (colocated.offload_weights: false)", weights),)
                                   if not offload_weights else ()))
    worst = max((refit, generating), key=lambda lines: sum(line.bytes for line in lines))
    moment = "refit" if worst is refit else "generation"
    knob = "raise policy.generation.vllm_cfg.tensor_parallel_size" if worst is refit else \
        "lower policy.generation.vllm_cfg.gpu_memory_utilization"
    return RolePlan("colocated hand-off", training.placement, worst, note=f"worst moment: {moment}", knob=knob)


def micro_batch_tokens(policy: Mapping[str, Any], *, train: bool) -> int:
    """Tokens in one micro-batch: with packing or dynamic batching, their token budget as the
    engine resolves it (scoring falls back to the training budget, both to the longest sequence),
    else rows times the longest sequence."""
    longest = int(policy.get("max_total_sequence_length") or 1)
    for section in ("sequence_packing", "dynamic_batching"):
        sub = policy.get(section) or {}
        if sub.get("enabled"):
            budget = sub.get("train_mb_tokens") if train else sub.get("logprob_mb_tokens") or sub.get("train_mb_tokens")
            return int(budget or longest)
    rows = policy.get("train_micro_batch_size" if train else "logprob_batch_size") or 1
    return int(rows) * longest
