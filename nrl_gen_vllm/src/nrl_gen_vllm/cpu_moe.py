"""Two repairs to vLLM's CPU MoE kernel (vLLM 0.32), installed in every vLLM worker process.

**Weight updates.** The kernel pads each expert's intermediate dimension to its alignment and
prepacks the weights into its grouped-GEMM layout, but only on the first load: on a weight update
vLLM skips that step (``UnquantizedFusedMoEMethod._setup_kernel``). During nrl's layerwise reload
the layer is rebuilt in checkpoint layout, so the kernel would then read unpacked weights as
packed ones (garbage), and where padding applies (an intermediate size per rank that is not a
multiple of the kernel's alignment, 32 on x86 and Arm, e.g. under tensor parallelism) the copy
back into the kernel's tensors fails on the shapes. nrl runs the skipped step on the rebuilt
layer while a refit loads (:func:`reloading`), so what is copied back has the kernel's layout.
A vLLM that processes updates itself would prepack twice: the CPU extra pins vLLM 0.32.

**Expert parallelism.** With ``enable_expert_parallel`` each rank holds a slice of the experts and
the router's choices arrive as global expert ids, which the GPU kernels translate through the
layer's ``expert_map``. vLLM's CPU kernel (``CPUUnquantizedExperts.apply``) ignores the map and
indexes its local experts with global ids: the first token routed past them reads out of bounds
and the worker dies (vLLM 0.32, ``csrc/cpu/cpu_fused_moe.cpp``). nrl translates the ids before the
kernel runs: a choice of a local expert gets its local slot, a choice of another rank's expert
gets weight zero (that rank adds it, and the layer's all-reduce sums the ranks).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Iterator
from typing import Any

import torch

_RELOADING = contextvars.ContextVar("nrl_cpu_moe_reloading", default=False)


@contextlib.contextmanager
def reloading() -> Iterator[None]:
    """While a refit loads: weight updates of CPU MoE layers get the kernel's own processing."""
    token = _RELOADING.set(True)
    try:
        yield
    finally:
        _RELOADING.reset(token)


def process_experts_on_reload() -> bool:
    """Run the CPU experts' ``process_weights_after_loading`` on weight updates inside
    :func:`reloading`; False when this vLLM has no such method."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    setup = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    if setup is None or getattr(setup, "_nrl_reload", False):
        return setup is not None

    def setup_kernel(self: Any, layer: Any, w13: torch.Tensor, w2: torch.Tensor) -> None:
        update = getattr(self, "moe_kernel", None) is not None
        setup(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and _RELOADING.get() and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)

    setup_kernel._nrl_reload = True  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel
    return True


def local_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  expert_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's global choices as this rank's local slots, other ranks' experts weighted zero
    (the kernel still computes those choices, with local slot 0, and adds nothing of them)."""
    local = torch.where(topk_ids >= 0, expert_map[topk_ids.clamp(min=0).long()], -1)
    weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
    return local.clamp(min=0).to(topk_ids.dtype), weights


def translate_expert_ids() -> bool:
    """Make vLLM's CPU MoE experts honour ``expert_map``; False when this vLLM has no such class."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        return False
    experts = getattr(cpu_moe, "CPUUnquantizedExperts", None)
    if experts is None or getattr(experts.apply, "_nrl_expert_map", False):
        return experts is not None
    apply = experts.apply

    def apply_with_expert_map(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                              w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              activation: Any, global_num_experts: int, expert_map: torch.Tensor | None,
                              *args: Any, **kwargs: Any) -> None:
        if expert_map is not None:
            if kwargs.get("apply_router_weight_on_input", args[-1] if args else False):
                raise NotImplementedError("nrl: expert parallelism on CPU with the router weight applied to the "
                                          "input (top-1 routing) is not supported; set "
                                          "policy.generation.vllm_cfg.expert_parallel_size: 1")
            topk_ids, topk_weights = local_routing(topk_ids, topk_weights, expert_map)
        # the ids are local now: what runs below (the kernel, or nrl's ungated experts) maps nothing again
        apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              None, *args, **kwargs)

    apply_with_expert_map._nrl_expert_map = True  # type: ignore[attr-defined]
    experts.apply = apply_with_expert_map
    return True


_UNGATED = {"silu_no_mul": torch.nn.functional.silu, "gelu_no_mul": torch.nn.functional.gelu,
            "gelu_tanh_no_mul": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
            "relu2_no_mul": lambda x: torch.square(torch.relu(x))}
"""The ungated expert activations (``act(x @ up) @ down``, no gate), as vLLM's GPU kernels define them."""


@torch.library.custom_op("nrl::ungated_experts", mutates_args=("output",), device_types="cpu")
def ungated_experts(output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                    w1_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    weighted: bool = True) -> None:
    """Experts without a gate (Nemotron-H's squared ReLU), one expert's tokens at a time: ``w1`` is
    ``[experts, intermediate, hidden]``, ``w2`` ``[experts, hidden, intermediate]``; ``output``
    gets each token's experts summed, weighted by the router unless it already scaled the input.
    A custom op, as vLLM's C++ kernel is, so that vLLM's compiled graph calls it whole: which
    experts a batch reaches is data, which a traced graph cannot branch on."""
    act = _UNGATED[activation]
    flat_ids = topk_ids.reshape(-1).long()
    tokens = torch.arange(hidden_states.shape[0], device=hidden_states.device).repeat_interleave(topk_ids.shape[1])
    weights = topk_weights.reshape(-1, 1).to(hidden_states.dtype)
    result = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    for expert in torch.unique(flat_ids[flat_ids >= 0]).tolist():
        chosen = (flat_ids == expert).nonzero(as_tuple=True)[0]
        rows = tokens[chosen]
        up = torch.nn.functional.linear(hidden_states[rows], w1[expert], None if w1_bias is None else w1_bias[expert])
        down = torch.nn.functional.linear(act(up), w2[expert], None if w2_bias is None else w2_bias[expert])
        result.index_add_(0, rows, (down * weights[chosen] if weighted else down).float())
    output.copy_(result.to(output.dtype))


@ungated_experts.register_fake
def _(output: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    return None


def run_ungated_experts() -> bool:
    """Let vLLM's CPU MoE layers run ungated experts (Nemotron-H's squared ReLU) through
    :func:`ungated_experts`: vLLM 0.32 refuses them on the CPU when it builds the layer, and its C++
    kernel computes gated ones only. The weights stay in checkpoint layout (no prepack), so weight
    updates load them as they are. False when this vLLM lacks the pieces patched."""
    try:
        from vllm.model_executor.layers.fused_moe import config as moe_config
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return False
    experts = CPUUnquantizedExperts
    if getattr(experts, "_nrl_ungated", False):  # a class mark: other repairs wrap ``apply`` after this one
        return True
    post_init = moe_config.FusedMoEConfig.__post_init__

    def post_init_ungated(self: Any) -> None:
        # vLLM's refusal is the last statement of __post_init__: past it the config is complete
        try:
            post_init(self)
        except NotImplementedError as error:
            if "is_act_and_mul=False" not in str(error) or self.activation.value not in _UNGATED:
                raise

    is_supported, process, apply = experts.is_supported_config, experts.process_weights_after_loading, experts.apply
    signature = inspect.signature(apply)

    def is_supported_config(cls: Any, moe: Any, *args: Any) -> tuple[bool, str | None]:
        if moe.activation.value in _UNGATED and moe.is_act_and_mul is False:
            return (True, None) if cls._supports_current_device() else (False, "kernel does not support this device")
        return is_supported(cls, moe, *args)

    def process_weights_after_loading(self: Any, layer: Any) -> None:
        if self.moe_config.activation.value in _UNGATED:
            self._use_zentorch = False
            return
        process(self, layer)

    def apply_ungated(self: Any, *args: Any, **kwargs: Any) -> None:
        given = signature.bind(self, *args, **kwargs).arguments
        activation = given["activation"]
        if activation.value not in _UNGATED:
            return apply(self, *args, **kwargs)
        topk_ids, topk_weights = given["topk_ids"], given["topk_weights"]
        if given.get("expert_map") is not None:  # not translated yet (translate_expert_ids passes None after)
            topk_ids, topk_weights = local_routing(topk_ids, topk_weights, given["expert_map"])
        ungated_experts(given["output"], given["hidden_states"], given["w1"], given["w2"], topk_weights, topk_ids,
                        activation.value, self.w1_bias, self.w2_bias,
                        weighted=not given.get("apply_router_weight_on_input", False))
        return None

    moe_config.FusedMoEConfig.__post_init__ = post_init_ungated
    experts.is_supported_config = staticmethod(is_supported_config)
    experts.process_weights_after_loading = process_weights_after_loading
    experts.apply = apply_ungated
    experts._nrl_ungated = True  # type: ignore[attr-defined]
    return True
