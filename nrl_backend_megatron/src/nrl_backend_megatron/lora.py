"""LoRA on the Megatron backend: adapters sharded as their base layer is, written here.

Why by hand: PEFT wraps ``torch.nn.Linear``, and Megatron's layers are its own tensor-parallel
``ColumnParallelLinear``/``RowParallelLinear``; Megatron-Bridge, which has Megatron LoRA, cannot be
installed beside this stack (docs/platform.md). The keys are NeMo RL's ``policy.megatron_cfg.peft``.

For a column-parallel base (``linear_qkv``, ``linear_fc1``: full input, output split over TP) A is
replicated ``[r, in]`` and B split like the base's rows ``[out/TP, r]``: every rank computes
``h = A x`` and its own slice of ``B h``; ``h`` passes Megatron's copy-to-TP region, so in backward
the partial ``dh`` of each slice is summed over TP and A's gradient is whole and equal on every
rank. For a row-parallel base (``linear_proj``, ``linear_fc2``: input split, output summed) A is
split like the base's columns ``[r, in/TP]`` and B replicated ``[out, r]``: the partial ``A x``
is summed over TP (Megatron's reduce-from-TP region), then every rank computes the whole ``B h``.
Under sequence parallelism the column-parallel base's input and the row-parallel base's output are
a slice of the sequence: ``h`` is gathered along it (column) or reduce-scattered (row) instead, so
the replicated A (column) or B (row) sees only its rank's tokens, and its gradient is marked for
the sum over TP that Megatron gives sequence-parallel weights.

A is drawn from one seeded generator per layer and sliced, so the adapters start the same at any
layout; B starts at zero, so step 0 is the base model.

The adapters hang off the model as ``model.lora`` (so DDP and the optimizer see them, and only
them, the base being frozen) and run as forward hooks on their base layers. Their checkpoint keys
carry the global layer number and their tensor-parallel axis; the base's own keys are unchanged.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nrl_backend_megatron.weights import canonical_name
from nrl_core.api import ConfigError

KEY = "policy.megatron_cfg.peft"
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ROW_PARALLEL = ("linear_proj", "linear_fc2")


def enabled(section: Mapping[str, Any] | None) -> bool:
    return bool((section or {}).get("enabled"))


def check_section(section: Mapping[str, Any], *, transformer_engine: bool) -> None:
    """What this implementation does not do, in one line each."""
    for name in section.get("target_modules") or []:
        if name not in TARGETS and not any(ch in name for ch in "*?"):
            raise ConfigError(f"{KEY}.target_modules", f"'{name}' is not a Megatron linear layer name; use "
                                                       f"{', '.join(TARGETS)} (or a glob over the module path)")
    if section.get("lora_B_init_method", "zero") != "zero":
        raise ConfigError(f"{KEY}.lora_B_init_method", "only 'zero' (the adapters start as the base model)")
    if section.get("lora_A_init_method", "xavier") not in ("xavier", "uniform"):
        raise ConfigError(f"{KEY}.lora_A_init_method", "use 'xavier' or 'uniform'")
    if section.get("lora_dtype") not in (None, "None"):
        raise ConfigError(f"{KEY}.lora_dtype", "the adapters take the model's dtype; set it to null")
    if transformer_engine:
        raise ConfigError(f"{KEY}.enabled", "LoRA on Transformer Engine's fused layer-norm linears is not supported "
                                             "yet; run LoRA on the dtensor backend (policy.dtensor_cfg.lora_cfg)")


def _wanted(path: str, section: Mapping[str, Any]) -> bool:
    """Whether the base layer at ``path`` (a module path) gets an adapter."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf not in TARGETS or ".experts." in path or ".shared_experts." in path:
        return False
    targets = list(section.get("target_modules") or []) or list(TARGETS)
    excluded = list(section.get("exclude_modules") or [])

    def matches(patterns: list[str]) -> bool:
        return any(leaf == p or fnmatch.fnmatch(path, p) for p in patterns)

    return matches(targets) and not matches(excluded)


class Adapter(nn.Module):
    """A and B of one base layer (see the module docstring for their sharding)."""

    def __init__(self, base: nn.Module, canonical: str, section: Mapping[str, Any], seed: int, tp_rank: int,
                 tp_size: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from nrl_backend_megatron.weights import tp_parts

        self.row = canonical.rsplit(".", 1)[-1] in ROW_PARALLEL
        self.canonical = canonical
        rank = int(section["dim"])
        self.scale = float(section["alpha"]) / rank
        out_local, in_local = base.weight.shape
        # the parts B's rows are sliced from, as the base's output is ([gate; up] for a gated MLP)
        self.tp_parts = None if self.row else tp_parts(f"{canonical}.weight", base.weight, out_local * tp_size)
        dtype, device = base.weight.dtype, base.weight.device
        full_in = in_local * tp_size if self.row else in_local
        a_full = torch.empty(rank, full_in, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed + int(hashlib.sha256(canonical.encode()).hexdigest()[:8], 16))
        if section.get("lora_A_init_method", "xavier") == "xavier":
            bound = math.sqrt(6.0 / (rank + full_in))
        else:  # PEFT's and torch.nn.Linear's kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in)
            bound = 1.0 / math.sqrt(full_in)
        a_full.uniform_(-bound, bound, generator=generator)
        a = torch.chunk(a_full, tp_size, dim=1)[tp_rank] if self.row else a_full
        self.A = nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
        self.B = nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))  # row: out is whole
        sharded, dim = (self.A, 1) if self.row else (self.B, 0)
        set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and tp_size > 1
        replicated = self.B if self.row else self.A
        replicated.sequence_parallel = self.sequence_parallel  # its gradient: this rank's tokens only
        self.dropout = nn.Dropout(float(section.get("dropout") or 0.0))
        self.post = section.get("dropout_position", "post") == "post"
        self.disabled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        h = nn.functional.linear(x if self.post else self.dropout(x), self.A)
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h) if self.row else gather_from_sequence_parallel_region(h)
        else:
            h = reduce_from_tensor_model_parallel_region(h) if self.row else copy_to_tensor_model_parallel_region(h)
        out = nn.functional.linear(h, self.B) * self.scale
        return self.dropout(out) if self.post else out

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` of this rank's slice, in the base weight's local layout."""
        return (self.B.detach().float() @ self.A.detach().float()) * self.scale


class Adapters(nn.Module):
    """Every adapter of the model, keyed by its base layer's canonical name (global layer number)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name = nn.ModuleDict()

    @staticmethod
    def key(canonical: str) -> str:
        return canonical.replace(".", "__")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        """Each adapter tensor under ``lora.<canonical name>.A|B``, sharded along its TP axis."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        for adapter in self.by_name.values():
            for name, tensor, sharded_axis in (("A", adapter.A, 1 if adapter.row else None),
                                               ("B", adapter.B, None if adapter.row else 0)):
                key = f"{prefix}{adapter.canonical}.{name}"
                local_key = f"{prefix}by_name.{self.key(adapter.canonical)}.{name}"
                if sharded_axis is None:
                    out[local_key] = make_sharded_tensor_for_checkpoint(tensor, key)
                else:
                    out[local_key] = make_tp_sharded_tensor_for_checkpoint(tensor, key, sharded_axis)
        return out


def attach(model: nn.Module, section: Mapping[str, Any], seed: int, tp_rank: int, tp_size: int) -> Adapters:
    """Freeze ``model`` and give its chosen linear layers adapters (``model.lora``); returns them."""
    for param in model.parameters():
        param.requires_grad_(False)
    adapters = Adapters()
    for path, module in list(model.named_modules()):
        if not _wanted(path, section) or not hasattr(module, "weight"):
            continue
        canonical = canonical_name(model, path)
        adapter = Adapter(module, canonical, section, seed, tp_rank, tp_size)
        adapters.by_name[Adapters.key(canonical)] = adapter
        module.register_forward_hook(_hook(adapter))
    if not adapters.by_name:
        raise ConfigError(f"{KEY}.target_modules", f"matches no layer of the model ({section.get('target_modules')} "
                                                   f"excluding {section.get('exclude_modules')})")
    model.lora = adapters
    return adapters


def _hook(adapter: Adapter) -> Any:
    def add(module: nn.Module, inputs: tuple, output: Any) -> Any:
        if adapter.disabled:
            return output
        extra = adapter(inputs[0])
        if isinstance(output, tuple):
            return (output[0] + extra, *output[1:])
        return output + extra

    return add


@contextlib.contextmanager
def disabled(adapters: Adapters) -> Iterator[None]:
    """The base model: every adapter switched off for the block (the reference policy)."""
    for adapter in adapters.by_name.values():
        adapter.disabled = True
    try:
        yield
    finally:
        for adapter in adapters.by_name.values():
            adapter.disabled = False


def merged_local(adapters: Adapters, canonical: str, local_weight: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the weight ``canonical`` with its adapter merged in (``W + scale * B @
    A`` in the base's local layout), or the slice itself where there is no adapter."""
    adapter = adapters.by_name[Adapters.key(canonical.removesuffix(".weight"))] \
        if canonical.endswith(".weight") and Adapters.key(canonical.removesuffix(".weight")) in adapters.by_name else None
    if adapter is None:
        return local_weight
    return (local_weight.float() + adapter.delta()).to(local_weight.dtype)


def adapter_shapes(adapters: Adapters) -> dict[str, list[int]]:
    return {f"{a.canonical}.{n}": list(t.shape) for a in adapters.by_name.values() for n, t in (("A", a.A), ("B", a.B))}


def full_adapters(adapters: Adapters, tp_group: Any, tp_size: int, pp_group: Any, pp_size: int) -> dict[str, Any]:
    """Every adapter's whole A and B (canonical name → (A, B) on the CPU), on every rank: gathered
    over TP, then exchanged between pipeline stages (adapters are small). Collective."""
    import torch.distributed as dist

    from nrl_backend_megatron.hybrid import join_parts
    from nrl_core.api import all_gather

    mine = {}
    for adapter in adapters.by_name.values():
        a, b = adapter.A.detach(), adapter.B.detach()
        if tp_size > 1:
            if adapter.row:
                a = torch.cat(all_gather(a.contiguous(), group=tp_group), dim=1)
            else:
                parts = all_gather(b.contiguous(), group=tp_group)
                # each rank holds its slice of each part (of a gated MLP: [gate_slice; up_slice])
                b = torch.cat(parts, dim=0) if adapter.tp_parts is None else join_parts(parts, adapter.tp_parts, 0)
        mine[adapter.canonical] = (a.float().cpu(), b.float().cpu())
    if pp_size == 1:
        return mine
    stages: list[Any] = [None] * pp_size
    dist.all_gather_object(stages, mine, group=pp_group)
    return {name: pair for stage in stages for name, pair in stage.items()}


def global_shapes(adapters: Adapters, tp_size: int, pp_group: Any, pp_size: int) -> dict[str, tuple[list[int], list[int]]]:
    """Every adapter's full A and B shapes (canonical name → shapes), in the order
    :func:`full_adapters` returns them, on every rank. Collective over pipeline stages."""
    import torch.distributed as dist

    mine = {}
    for adapter in adapters.by_name.values():
        a, b = list(adapter.A.shape), list(adapter.B.shape)
        if adapter.row:
            a[1] *= tp_size
        else:
            b[0] *= tp_size
        mine[adapter.canonical] = (a, b)
    if pp_size == 1:
        return mine
    stages: list[Any] = [None] * pp_size
    dist.all_gather_object(stages, mine, group=pp_group)
    return {name: shapes for stage in stages for name, shapes in stage.items()}


def peft_items(canonical: str, a: torch.Tensor, b: torch.Tensor, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One adapter under PEFT's names on HF modules: a fused ``linear_qkv`` adapter becomes
    ``q_proj``, ``k_proj`` and ``v_proj`` adapters sharing A (each takes its rows of B), and
    ``linear_fc1``'s becomes ``gate_proj`` and ``up_proj``'s: the same ``B @ A`` per HF weight."""
    from nrl_backend_megatron.convert.mapping import megatron_to_hf_items

    for hf_name, b_part in megatron_to_hf_items(f"{canonical}.weight", b, hf_config):
        module = hf_name.removesuffix(".weight")
        yield f"base_model.model.{module}.lora_A.weight", a
        yield f"base_model.model.{module}.lora_B.weight", b_part


def peft_config(section: Mapping[str, Any], names: Iterable[str], base_model: str) -> Any:
    """PEFT's ``LoraConfig`` for adapters of these PEFT tensor names."""
    from peft import LoraConfig

    targets = sorted({name.rsplit(".", 3)[1] for name in names})  # ...<module>.lora_A.weight
    config = LoraConfig(r=int(section["dim"]), lora_alpha=float(section["alpha"]), target_modules=targets,
                        lora_dropout=float(section.get("dropout") or 0.0), bias="none", task_type="CAUSAL_LM")
    config.base_model_name_or_path = base_model
    return config


def write_peft_adapter(adapters: Adapters, full: Mapping[str, Any], section: Mapping[str, Any], hf_config: Any,
                       base_model: str, tokenizer_source: str, path: str) -> None:
    """The adapters as PEFT's adapter directory on HF module names (see :func:`peft_items`)."""
    from pathlib import Path

    from safetensors.torch import save_file

    from nrl_core.api import copy_tokenizer

    state = {name: t.clone().contiguous() for canonical, (a, b) in full.items()  # A shared by q, k, v: a copy each
             for name, t in peft_items(canonical, a, b, hf_config)}
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config(section, state, base_model).save_pretrained(str(out))
    copy_tokenizer(tokenizer_source, out)
