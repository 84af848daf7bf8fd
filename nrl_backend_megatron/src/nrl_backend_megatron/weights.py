"""Move full canonical Megatron tensors into a tensor/pipeline-sharded model and back out.

A rank holds a pipeline stage (a contiguous range of decoder layers, plus the embedding on the
first stage and the output layer on the last) and, of each tensor-parallel parameter, the slice
along its ``partition_dim``. A tensor fused of parts is the exception: each rank holds its slice of
every part, one after the other (the gated MLP input ``linear_fc1`` holds ``[gate_slice;
up_slice]``, Mamba's input projection its slice of each of five parts), so parts are split
separately. Export gathers across the
tensor-parallel group (all-gather) and then the pipeline group (broadcast from the owning stage),
so every rank sees every full tensor: a collective, every rank must iterate.

Routed experts are never tensor-parallel here (expert tensor parallel size 1); with expert
parallelism a rank holds ``num_experts / EP`` whole experts of each MoE layer, named locally
``local_experts.<j>``. Canonical names carry the global expert index, and export gathers a layer's
experts with one all-gather per projection over the expert-parallel group (every rank's experts
stacked into one message) rather than one transfer per expert.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from nrl_backend_megatron.convert.mapping import local_name
from nrl_backend_megatron.hybrid import join_parts, slice_parts
from nrl_core.api import all_gather, broadcast

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)\.(.*)$")


def canonical_name(model: Any, name: str) -> str:
    """A parameter's or module's name on this rank with the global layer and expert index."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer = model.decoder.layers[int(m.group(1))]
    canon = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
    expert = _EXPERT.match(canon)
    if expert:
        index = layer.mlp.local_expert_indices[int(expert.group(2))]
        canon = f"{expert.group(1)}{index}.{expert.group(3)}"
    return canon


#: Buffers that are weights of a checkpoint: DeepSeek-V3's routing correction bias, which chooses
#: experts and is not trained by gradients (Megatron's router keeps it as a buffer).
WEIGHT_BUFFERS = ("mlp.router.expert_bias",)


def canonical_param_names(model: Any) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """Canonical (global layer and expert index, local-spec) name → (local name, parameter) on this
    rank; the :data:`WEIGHT_BUFFERS` among them too, since checkpoints and refits carry them."""
    names = {local_name(canonical_name(model, name)): (name, param) for name, param in model.named_parameters()}
    names.update({canonical_name(model, name): (name, buffer) for name, buffer in model.named_buffers()
                  if name.endswith(WEIGHT_BUFFERS)})
    return names


def is_expert(canonical: str) -> bool:
    """Whether a canonical name is a routed expert's weight (split by expert parallelism, never by TP)."""
    return _EXPERT.match(canonical) is not None


def tp_parts(name: str, param: torch.Tensor, full_rows: int) -> tuple[int, ...] | None:
    """The parts a tensor-parallel slice is cut from, each split over the ranks (None: one part):
    what :mod:`~nrl_backend_megatron.hybrid` recorded, else ``[gate; up]`` for a gated MLP input."""
    if hasattr(param, "nrl_tp_parts"):
        return param.nrl_tp_parts
    return (full_rows // 2, full_rows // 2) if name.endswith("linear_fc1.weight") else None


def shard(full: torch.Tensor, param: torch.Tensor, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor for ``param``."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False) or is_expert(name):
        return full
    dim = param.partition_dim
    parts = tp_parts(name, param, full.shape[dim])
    if parts is not None:
        return slice_parts(full, parts, dim, tp_rank, tp_size)
    return torch.chunk(full, tp_size, dim=dim)[tp_rank]


def unshard(local: torch.Tensor, param: torch.Tensor, name: str, tp_group: Any, tp_size: int) -> torch.Tensor:
    """The full tensor from every tensor-parallel rank's slice (collective over ``tp_group``)."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False) or is_expert(name):
        return local
    parts = all_gather(local, group=tp_group)
    split = tp_parts(name, param, local.shape[param.partition_dim] * tp_size)
    if split is not None:
        return join_parts(parts, split, param.partition_dim)
    return torch.cat(parts, dim=param.partition_dim)


@torch.no_grad()
def load_full_state(model: Any, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int,
                    tied: bool) -> None:
    """Copy canonical full tensors into this rank's parameters; every parameter must be covered."""
    params = canonical_param_names(model)
    for canon, (_name, param) in params.items():
        source = canon
        if canon == "output_layer.weight" and tied:
            source = "embedding.word_embeddings.weight"
        if source not in full:
            raise KeyError(f"converted checkpoint has no tensor for '{canon}'")
        piece = shard(full[source], param, canon, tp_rank, tp_size)
        if tuple(piece.shape) != tuple(param.shape):
            raise ValueError(f"shape mismatch for '{canon}': checkpoint {tuple(piece.shape)} vs model "
                             f"{tuple(param.shape)}")
        param.copy_(piece.to(param.dtype))


@torch.no_grad()
def iter_full_tensors(model: Any, shapes: dict[str, tuple[int, ...]], *, tp_group: Any, tp_size: int,
                      pp_group: Any, pp_size: int, pp_rank: int, dtype: torch.dtype, ep_group: Any = None,
                      ep_size: int = 1,
                      local_values: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every canonical tensor in full on every rank, in the order of ``shapes``. Collective.
    ``local_values(canonical, local slice)`` replaces a slice before it is gathered (LoRA's merge)."""
    local = canonical_param_names(model)
    device = next(model.parameters()).device  # stages that do not own a tensor receive it here
    owners = _stage_owners(model, shapes, pp_group, pp_size, pp_rank)
    experts: dict[str, torch.Tensor] = {}  # the current layer's gathered experts, handed out in order
    for canon, shape in shapes.items():
        owner = owners[canon]
        if owner == pp_rank and is_expert(canon):
            if canon not in experts:
                experts = _gather_layer_experts(local, canon, ep_group, ep_size, dtype)
            full = experts.pop(canon)
        elif owner == pp_rank:
            name, param = local[canon]
            data = param.data if local_values is None else local_values(canon, param.data)
            full = unshard(data, param, canon, tp_group, tp_size)
            # never hand out a live parameter: the consumer may keep it while training goes on
            full = full.to(dtype=dtype, copy=full.data_ptr() == param.data.data_ptr())
        else:
            full = torch.empty(shape, dtype=dtype, device=device)
        if pp_size > 1:
            full = broadcast(full.contiguous(), src=dist.get_global_rank(pp_group, owner), group=pp_group)
        yield canon, full


def _gather_layer_experts(local: dict[str, tuple[str, torch.nn.Parameter]], canon: str, ep_group: Any,
                          ep_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every expert of ``canon``'s layer in full: per projection, this rank's experts stacked and
    all-gathered over the expert-parallel group (whose ranks hold consecutive expert ranges)."""
    prefix = _EXPERT.match(canon).group(1)  # type: ignore[union-attr]
    by_suffix: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, (_, param) in local.items():
        m = _EXPERT.match(name)
        if m and m.group(1) == prefix:
            by_suffix.setdefault(m.group(3), []).append((int(m.group(2)), param.data))
    out: dict[str, torch.Tensor] = {}
    for suffix, items in by_suffix.items():
        items.sort(key=lambda item: item[0])
        stacked = torch.stack([t for _, t in items]).to(dtype)  # a copy: never a live parameter
        if ep_size > 1:
            stacked = torch.cat(all_gather(stacked, group=ep_group))
        for e in range(stacked.shape[0]):  # expert-parallel rank r holds experts r*n .. r*n + n - 1
            out[f"{prefix}{e}.{suffix}"] = stacked[e]
    return out


def _stage_owners(model: Any, shapes: dict[str, tuple[int, ...]], pp_group: Any, pp_size: int,
                  pp_rank: int) -> dict[str, int]:
    """Which pipeline stage holds each canonical tensor (the embedding's first holder wins); a
    stage holds every expert of its MoE layers, whichever expert-parallel rank keeps each."""
    mine = set(canonical_param_names(model))
    mine |= {n for n in shapes if is_expert(n) and n.split(".mlp.")[0] + ".mlp.router.weight" in mine}
    flags = torch.tensor([[1 if n in mine else 0 for n in shapes]], dtype=torch.int64)
    if pp_size > 1:
        table = torch.cat(all_gather(flags, group=pp_group), 0)
    else:
        table = flags
    owners: dict[str, int] = {}
    for j, name in enumerate(shapes):
        holders = torch.nonzero(table[:, j]).flatten().tolist()
        if not holders:
            raise KeyError(f"no pipeline stage holds '{name}'")
        owners[name] = holders[0]
    return owners
