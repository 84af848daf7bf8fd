"""gpt-oss in Megatron-Core's terms.

Megatron-Core has each piece gpt-oss needs, under its own names: a learned sink logit per head
(``softmax_type: learnable``, the attention's ``softmax_offset``), sliding windows on some layers
(``window_size`` with a per-layer list), the clamped gated unit ``(up + 1) * quick_gelu(gate)``
(``quick_gelu``, ``glu_linear_offset``, ``activation_func_clamp_value``), biases on every
projection, router and expert (``add_bias_linear``, which weights each expert's output bias by its
routing probability, as HF does), and YaRN's rescaled cos and sin (the ``yarn_*`` attributes its
attention reads). The RoPE frequencies themselves are HF's, as for every family (model.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from nrl_core.api import ConfigError

#: Megatron-Core's ``quick_gelu`` is ``x * sigmoid(1.702 x)``: gpt-oss's ``swiglu_alpha`` must be that.
QUICK_GELU_ALPHA = 1.702
KEY = "policy.model_name"


def check(hf_config: Any) -> None:
    """One-line refusals for a gpt-oss config Megatron-Core would compute otherwise."""
    alpha = float(getattr(hf_config, "swiglu_alpha", QUICK_GELU_ALPHA))
    if not math.isclose(alpha, QUICK_GELU_ALPHA):
        raise ConfigError(KEY, f"gpt-oss with swiglu_alpha {alpha} is not supported by the Megatron backend "
                               f"(Megatron-Core's quick_gelu fixes it at {QUICK_GELU_ALPHA})")
    kinds = set(layer_types(hf_config))
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ConfigError(KEY, f"gpt-oss layer types {sorted(kinds)} are not supported by the Megatron backend; "
                               "supported: sliding_attention, full_attention")


def layer_types(hf_config: Any) -> list[str]:
    return list(getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers)


def config_kwargs(hf_config: Any) -> dict[str, Any]:
    """``TransformerConfig`` fields of gpt-oss's layers (the experts' routing is moe.py's)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    check(hf_config)
    windowed = [kind == "sliding_attention" for kind in layer_types(hf_config)]
    kwargs: dict[str, Any] = dict(
        ffn_hidden_size=int(hf_config.intermediate_size), gated_linear_unit=True, activation_func=quick_gelu,
        glu_linear_offset=1.0, activation_func_clamp_value=float(hf_config.swiglu_limit),
        add_bias_linear=True, add_qkv_bias=True, softmax_type="learnable")
    if any(windowed) and getattr(hf_config, "sliding_window", None):
        # HF's window of W keys: position i sees i - W < j <= i, Megatron's (left, right) counts
        # the keys on each side of the query
        kwargs.update(window_size=(int(hf_config.sliding_window) - 1, 0),
                      window_attn_skip_freq=[1 if w else 0 for w in windowed])
    return kwargs


def yarn_attributes(hf_config: Any) -> dict[str, Any]:
    """What Megatron-Core's attention reads to scale cos and sin as YaRN does (HF's
    ``attention_factor``, ``0.1 ln(factor) + 1`` without ``mscale``); none for plain RoPE."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "yarn":
        return {}
    if params.get("attention_factor") is not None or params.get("mscale") or params.get("mscale_all_dim"):
        raise ConfigError(KEY, "gpt-oss with YaRN's attention_factor or mscale set is not supported by the Megatron "
                               "backend (its attention scales cos and sin by 0.1 ln(factor) + 1)")
    return {"yarn_rotary_scaling_factor": float(params["factor"]), "yarn_mscale": None, "yarn_mscale_all_dim": None}


def mark_sinks_tensor_parallel(model: Any) -> None:
    """Each tensor-parallel rank holds the sinks of its own heads, but Megatron-Core does not mark
    them as split: marked as its split parameters are, nrl's loading and export cut and gather
    them by head, and gradient norms count them once per rank, not as copies of rank 0's."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    on_meta = any(param.is_meta for param in model.parameters())  # the conversion's build
    for name, param in list(model.named_parameters()):
        if name.endswith("core_attention.softmax_offset"):
            if on_meta and not param.is_meta:  # Megatron-Core allocates them on a device it names
                param = torch.nn.Parameter(torch.empty_like(param, device="meta"))
                model.get_submodule(name.rsplit(".", 1)[0]).softmax_offset = param
            set_tensor_model_parallel_attributes(param, True, 0, 1)


@functools.cache
def _expert_output_projection() -> type:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertOutputProjection(RowParallelLinear):
        """An expert's ``linear_fc2`` whose output is a tensor of its own, and whose bias is marked
        as the expert's other tensors are.

        Megatron's MLP adds the expert's bias, weighted, into that output in place; without expert
        parallelism or tensor parallelism the output is what Megatron's reduction handed back as it
        was, a view that autograd refuses to see modified in place. Megatron-Core marks the bias as
        a row-parallel layer's: sequence-parallel, whose gradient it sums over the tensor-parallel
        ranks, and held whole by each of them, whose gradient norm only their first counts. An
        expert's bias is neither here: its gradient is summed once over the experts'
        data-parallel group (which holds those ranks' shares of the sequence), and every rank
        holds the whole expert and counts all of it. With Megatron's marks, tensor parallel 2
        trained the bias on twice its gradient and its second rank clipped by another norm."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.bias is not None and self.is_expert:
                self.bias.sequence_parallel = False
                self.bias.tensor_model_parallel, self.bias.partition_dim, self.bias.partition_stride = True, 0, 1

        def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            output, bias = super().forward(input_, *args, **kwargs)
            return (output.clone() if bias is not None and output._base is not None else output), bias

    return ExpertOutputProjection


def with_expert_output_projections(block: Any) -> Any:
    """The local layer spec's experts, with :func:`_expert_output_projection` as their ``linear_fc2``."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules

    for spec in block.layer_specs:
        experts = getattr(getattr(spec.submodules.mlp, "submodules", None), "experts", None)
        submodules = getattr(experts, "submodules", None)
        if isinstance(submodules, MLPSubmodules) and submodules.linear_fc2 is RowParallelLinear:
            experts.submodules = dataclasses.replace(submodules, linear_fc2=_expert_output_projection())
    return block
