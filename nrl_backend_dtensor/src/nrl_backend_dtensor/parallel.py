"""Sharding the model: a (dp, tp) device mesh, DTensor tensor parallelism, FSDP2.

Order matters and follows the composable-parallelism recipe: tensor parallelism first (it replaces
the decoder layers' projection weights with DTensors over the ``tp`` mesh), then activation
checkpointing, then ``fully_shard`` per decoder layer, on the output head when it is not tied to the
input embedding, and at the root over the ``dp`` mesh (skipped where it would shard
nothing: one data-parallel rank, float32, no CPU offload).

The default plan splits attention heads and MLP columns (q/k/v and gate/up column-wise, o and down
row-wise). Hugging Face attention reshapes with ``-1`` heads, so local head counts follow from the
local projection widths; Qwen3's q_norm/k_norm act per head and need nothing. Embeddings, the final
norm and the output head stay replicated over ``tp`` (sharded over ``dp`` by FSDP).

With ``sequence_parallel`` each decoder layer receives the full sequence, shards it over ``tp``
along the sequence for its norms and residual stream, gathers it back for attention and the MLP
(which need every position) and returns the full sequence: activations inside a layer shrink by
the TP size while the model-level code (rotary embeddings, mask construction) sees ordinary
tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from nrl_backend_dtensor.checks import check_context_parallel, check_heads, resolve_parallel_plan
from nrl_core.api import ConfigError

LayerPlan = dict[str, ParallelStyle]


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Where this rank sits: its data-parallel coordinate and the mesh it belongs to."""

    mesh: DeviceMesh
    dp_rank: int
    dp_size: int
    tp_size: int

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()


def build_layout(device_type: str, tp_size: int, cp_size: int = 1) -> ParallelLayout:
    """A 2-D ``(dp, tp)`` mesh over the whole world; one-line errors for impossible sizes."""
    check_context_parallel(cp_size)
    world = dist.get_world_size()
    if tp_size < 1 or world % tp_size:
        raise ConfigError("policy.dtensor_config.tensor_parallel_size",
                          f"{tp_size} does not divide the world size {world}")
    mesh = init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return ParallelLayout(mesh=mesh, dp_rank=mesh.get_local_rank("dp"), dp_size=world // tp_size, tp_size=tp_size)


def default_layer_plan(sequence_parallel: bool) -> LayerPlan:
    """Column/row-wise plan for a Llama/Qwen2/Qwen3 decoder layer (module names shared by all three)."""
    if not sequence_parallel:
        col, row = ColwiseParallel, RowwiseParallel
        return {"self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
                "self_attn.o_proj": row(), "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row()}
    seq_in = dict(input_layouts=Shard(1))
    return {
        "input_layernorm": SequenceParallel(use_local_output=False),
        "self_attn.q_proj": ColwiseParallel(**seq_in), "self_attn.k_proj": ColwiseParallel(**seq_in),
        "self_attn.v_proj": ColwiseParallel(**seq_in), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(use_local_output=False),
        "mlp.gate_proj": ColwiseParallel(**seq_in), "mlp.up_proj": ColwiseParallel(**seq_in),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def _layer_plan_factory(custom: str | None) -> Callable[[nn.Module, Any, bool], LayerPlan]:
    if custom is None:
        return lambda layer, config, sp: default_layer_plan(sp)
    return resolve_parallel_plan(custom)


def apply_tensor_parallel(hf_model: nn.Module, layout: ParallelLayout, *, sequence_parallel: bool,
                          custom_plan: str | None) -> None:
    """Parallelize every decoder layer over ``layout.tp_mesh`` (no-op at TP size 1)."""
    if layout.tp_size == 1:
        return
    config = hf_model.config
    check_heads(layout.tp_size, config)
    factory = _layer_plan_factory(custom_plan)
    for layer in hf_model.model.layers:
        if sequence_parallel:
            parallelize_module(layer, layout.tp_mesh, PrepareModuleInputOutput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
        parallelize_module(layer, layout.tp_mesh, factory(layer, config, sequence_parallel))


def fsdp_needed(layout: ParallelLayout, *, param_dtype: torch.dtype, cpu_offload: bool) -> bool:
    """Whether ``fully_shard`` does anything here. At one data-parallel rank in float32 without CPU
    offload it shards nothing, yet gathers every layer's parameters into a fresh buffer before each
    forward and backward and copies gradients out after: 7% of a training step on CPU (measured in
    docs/benchmarks.md). Mixed precision and CPU offload are FSDP's to do, so they keep it."""
    return layout.dp_size > 1 or param_dtype != torch.float32 or cpu_offload


def output_head_unit(hf_model: nn.Module) -> nn.Module | None:
    """The output head, to be an FSDP unit of its own. Left in the root it stays gathered from the
    first forward to the end of backward, with its whole gradient, a cost per rank of the
    vocabulary's size that does not fall with the data-parallel size; on its own its gradient is
    reduced, and its weights resharded, as soon as its backward is done. The input embedding stays
    in the root: its gradient comes last in backward anyway, and a unit of its own would gather
    it a second time for nothing. Tied to the embedding, the head stays with it; a value model's
    score head is too small to matter."""
    embed = hf_model.get_input_embeddings()
    head = hf_model.get_output_embeddings()
    if embed is None or head is None or getattr(head, "weight", None) is getattr(embed, "weight", None):
        return None
    return head


def apply_fsdp(model: nn.Module, layers: nn.ModuleList, layout: ParallelLayout, *, param_dtype: torch.dtype,
               cpu_offload: bool, head: nn.Module | None = None) -> bool:
    """``fully_shard`` each decoder layer, the output ``head`` (:func:`output_head_unit`), then the
    root (which keeps the rest), where :func:`fsdp_needed`; returns whether it did. The head is
    gathered once per forward and kept until its backward, which comes right after."""
    if not fsdp_needed(layout, param_dtype=param_dtype, cpu_offload=cpu_offload):
        return False
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype != torch.float32 else MixedPrecisionPolicy()
    kwargs: dict[str, Any] = dict(mesh=layout.dp_mesh, mp_policy=mp)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **kwargs)
    if head is not None:
        fully_shard(head, reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)
    return True
