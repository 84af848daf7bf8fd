"""Megatron-Core's local norms, allowed under sequence parallelism.

Why: Megatron-Core's torch norm refuses sequence parallelism only because it does not mark its
weights. A norm acts on each token alone, so a rank holding a slice of the sequence computes what
it would on the whole; its weights' gradients are then partial sums, which Megatron's gradient
finalisation all-reduces over the tensor-parallel group for every parameter marked
``sequence_parallel``, as it does for Transformer Engine's norms. With the mark, sequence
parallelism (and with it a mixture-of-experts model at tensor parallel 2 or more) runs where
Transformer Engine cannot, as on the CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class SequenceParallelTorchNorm:
    """torch's ``LayerNorm`` or ``RMSNorm`` as Megatron-Core's spec builds it, its weights marked
    for the tensor-parallel all-reduce when the config splits the sequence."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: torch's norms are {', '.join(kinds)}")
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs Transformer Engine's norms")
        # persist_layer_norm and memory_efficient_layer_norm choose Apex's and Transformer Engine's
        # kernels; torch's norm has one kernel, so they do not apply here
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for weight in norm.parameters():
            weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_sequence_parallel_norms(spec: Any) -> Any:
    """``spec`` (a module spec, its submodules or a list of them: dataclasses all, a norm being a
    field's value), with every torch norm of Megatron-Core's local spec replaced by
    :class:`SequenceParallelTorchNorm`, in place."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if isinstance(spec, list):
        for item in spec:
            with_sequence_parallel_norms(item)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if value is WrappedTorchNorm:
                setattr(spec, field.name, SequenceParallelTorchNorm)
            else:
                with_sequence_parallel_norms(value)
    return spec
