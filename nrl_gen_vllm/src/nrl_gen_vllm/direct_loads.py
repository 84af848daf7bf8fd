"""gpt-oss's tensors that vLLM's loader writes past the weight loaders, routed through them for a refit.

vLLM's layerwise reload, which every nrl refit uses, puts each layer's tensors on the meta device
and loads only what comes through the parameters' weight loaders. vLLM's gpt-oss loader copies the
stacked experts (``mlp.experts.gate_up_proj``, ``down_proj`` and their biases) and the attention
sinks straight into their parameters instead: into meta tensors during a reload, so a refit left
them at their old values.

vLLM can also load gpt-oss's experts one at a time, through the experts' weight loader, which cuts
each rank's tensor-parallel part and skips the experts another rank holds
(``mlp.experts.<id>.gate_up_proj``: its per-expert checkpoints). So a stacked tensor goes in as its
per-expert views, and each rank's sinks (its heads) go through their parameter's loader here.
vLLM keeps those views until their layer is complete, and a view keeps the buffer it lies in: a
layer whose experts straddle two buckets holds the first bucket's buffer until the second is loaded
(``released.py`` copies out only the tensors it handed, not views of them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def takes_this_route(model: Any) -> bool:
    """Whether ``model`` (vLLM's model, unwrapped) is one whose loader writes past its weight loaders."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    return isinstance(model, GptOssForCausalLM)


_STACKED_EXPERTS = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<tensor>(?:gate_up|down)_proj(?:_bias)?)$")
_SINKS = re.compile(r"^.+\.self_attn\.sinks$")


def through_weight_loaders(named: Iterable[tuple[str, torch.Tensor]], model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (HF names) as ``model.load_weights`` must see them for its weight loaders to get
    every tensor: each stacked expert tensor as one view per expert; the sinks loaded here, through
    their parameter's loader, and left out of what is yielded."""
    for name, tensor in named:
        stacked = _STACKED_EXPERTS.match(name)
        if stacked is not None:
            for expert in range(tensor.shape[0]):
                yield f"{stacked['experts']}.{expert}.{stacked['tensor']}", tensor[expert]
        elif _SINKS.match(name):
            load_sinks(model, name, tensor)
        else:
            yield name, tensor
        del tensor  # not kept while the next arrives (released.py)


def load_sinks(model: Any, name: str, tensor: torch.Tensor) -> None:
    """One layer's attention sinks, this rank's heads of them (vLLM's loader cuts them so), through
    the parameter's weight loader; nothing for a layer of another pipeline stage."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.utils import is_pp_missing_parameter

    mapped = model.hf_to_vllm_mapper.map_name(name)
    if mapped is None or is_pp_missing_parameter(mapped, model):
        return
    param = model.get_parameter(mapped)
    heads = param.shape[0]
    loader = getattr(param, "weight_loader", default_weight_loader)
    loader(param, tensor.narrow(0, get_tensor_model_parallel_rank() * heads, heads))
