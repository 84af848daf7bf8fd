"""Latent attention's down-projections without Transformer Engine, whole on every tensor-parallel rank.

Why: Megatron-Core's ``MLASelfAttention`` builds its query and key-value down-projections as
Transformer Engine's duplicated ``TELinear`` when it can, else as a ``ColumnParallelLinear`` whose
output it gathers. The rotary part of that output (one key per token, shared by all heads) then
gets from each rank only the gradient of that rank's heads, and the gather's backward keeps the
rank's slice of it: under tensor parallelism its weights trained on partial gradients (measured on
the tiny DeepSeek-V3 at TP 2: the second step's loss off by 1e-3, the first grad norm by 0.2%).
Built as a plain linear layer instead, each rank projects its own slice of the sequence (sequence
parallelism, which nrl requires of a mixture-of-experts model at TP 2 or more); Megatron then
gathers the rotary part over the sequence, whose backward sums every rank's heads, and all-reduces
the weights' gradients over the tensor-parallel group, as for a norm's (``sequence_parallel``).
"""

from __future__ import annotations

from typing import Any

import torch


class DuplicatedLinear(torch.nn.Module):
    """``y = x W^T`` with the whole ``W`` on every tensor-parallel rank, in the calling convention of
    Megatron's linear layers (``(output, bias)``)."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any, bias: bool = False,
                 skip_bias_add: bool = False, **_: Any) -> None:
        super().__init__()
        if bias:
            raise ValueError("nrl: latent attention's down-projections have no bias")
        if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
            # each rank would see the whole sequence and keep only its own heads' rotary gradient
            raise ValueError("nrl: latent attention at tensor_model_parallel_size > 1 needs sequence_parallel: true")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()  # None: a meta build stays meta
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization and not self.weight.is_meta:
            init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden_states, self.weight), None


def use_duplicated_down_projections(attention_spec: Any) -> None:
    """Build ``attention_spec``'s (an ``MLASelfAttention`` spec of the local layer spec) down-projections
    as :class:`DuplicatedLinear`. ``MLASelfAttention`` accepts a plain linear layer there under the
    name ``Linear`` (Transformer Engine's modelopt layer), which this rebinds: without Transformer
    Engine that name has no other use."""
    import megatron.core.transformer.multi_latent_attention as latent

    latent.Linear = DuplicatedLinear
    attention_spec.submodules.linear_kv_down_proj = DuplicatedLinear
    if getattr(attention_spec.submodules, "linear_q_down_proj", None) is not None:
        attention_spec.submodules.linear_q_down_proj = DuplicatedLinear
