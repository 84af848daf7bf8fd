"""NeMo RL's memory keys of ``policy.megatron_cfg``: activation recompute and emptying the CUDA cache.

Activation recompute, as NeMo RL sets it (``nemo_rl/models/megatron/setup.py``,
``_apply_performance_config``): only with ``activation_checkpointing: true``;
``recompute_granularity: full`` recomputes every transformer layer (Megatron-Core's ``uniform``
method, one layer per unit), ``selective`` recomputes the ``recompute_modules`` (null: Megatron-Core's
default, ``core_attn``). NeMo RL has no ``recompute_method`` or ``recompute_num_layers`` keys: it
fixes them as here. Modules Megatron-Core refuses for nrl's models, or that need Transformer Engine,
are refused in one line (:func:`check_recompute`) instead of inside a worker.

``empty_unused_memory_level`` (0, 1, 2): where NeMo RL's Megatron policy worker calls
``torch.cuda.empty_cache()`` and from which level (:data:`EMPTY_CACHE_POINTS`).

:func:`release_storage` frees the weights DDP's contiguous buffer is about to copy, so a rank
never holds them twice while it loads.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nrl_core.api import ConfigError, trim_host_heap

KEY = "policy.megatron_cfg"
GRANULARITIES = ("full", "selective")
# Megatron-Core 0.16's choices (TransformerConfig.recompute_modules), NeMo RL's list too
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_MODULES = ("core_attn",)

# point -> the lowest level that empties the cache there; NeMo RL 7ea279a,
# nemo_rl/models/policy/workers/megatron_policy_worker.py
EMPTY_CACHE_POINTS: dict[str, int] = {
    "after_forward_backward": 1,  # train(): the step's forward/backward done, before the optimizer (:937)
    "after_optimizer_step": 2,  # train(): after the optimizer step (:1001)
    "reference_swapped_in": 1,  # use_reference_model(): the reference weights in place (:1999, gc first)
    "reference_swapped_out": 1,  # use_reference_model(): the policy's weights back (:2031, gc first)
    "after_prepare_for_training": 1,  # prepare_for_training(): weights and optimizer back on the device (:3032)
}
_GC_FIRST = frozenset({"reference_swapped_in", "reference_swapped_out"})


def empties_cache(level: int, point: str) -> bool:
    """Whether ``empty_unused_memory_level`` ``level`` empties the CUDA cache at ``point``."""
    return int(level) >= EMPTY_CACHE_POINTS[point]


def empty_unused_memory(level: int, point: str) -> bool:
    """Empty the CUDA cache at ``point`` when ``level`` says so (a no-op without CUDA); whether it
    was due."""
    if not empties_cache(level, point):
        return False
    import torch

    if torch.cuda.is_available():
        if point in _GC_FIRST:
            gc.collect()
        torch.cuda.empty_cache()
    return True


def _modules(section: Mapping[str, Any]) -> list[str]:
    modules = section.get("recompute_modules")
    return list(DEFAULT_MODULES if modules is None else modules)


def check_recompute(section: Mapping[str, Any], hf_config: Any = None, *, transformer_engine: bool) -> None:
    """One line for recompute settings Megatron-Core refuses for this model or cannot run here.

    ``transformer_engine``: whether the workers' layers are Transformer Engine's (the driver, which
    cannot know, passes whether it is installed at all). Module names are checked even while
    ``activation_checkpointing`` is off; what they need only when they take effect.
    """
    modules = section.get("recompute_modules")
    if modules is not None:
        if isinstance(modules, str) or not all(isinstance(m, str) for m in modules):
            raise ConfigError(f"{KEY}.recompute_modules", f"must be a list of module names, got {modules!r}")
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"{KEY}.recompute_modules", f"unknown module {unknown[0]!r}; Megatron-Core recomputes "
                                                          f"{', '.join(RECOMPUTE_MODULES)}")
    granularity = section.get("recompute_granularity") or "full"
    if granularity not in GRANULARITIES:
        raise ConfigError(f"{KEY}.recompute_granularity", f"must be 'full' or 'selective', got {granularity!r}")
    if not section.get("activation_checkpointing") or granularity != "selective":
        return
    chosen = _modules(section)
    if "moe_act" in chosen:
        raise ConfigError(f"{KEY}.recompute_modules", "'moe_act' recomputes the activation of grouped-GEMM experts "
                                                      "(moe_grouped_gemm), which nrl's Megatron backend does not run "
                                                      "(its experts are SequentialMLP); use 'moe' instead")
    if "mla_up_proj" in chosen:
        raise ConfigError(f"{KEY}.recompute_modules", "'mla_up_proj' (multi-latent attention's up-projections) is "
                                                      "not recomputed by nrl's Megatron backend yet; remove it")
    if "layernorm" in chosen and not transformer_engine:
        raise ConfigError(f"{KEY}.recompute_modules", "'layernorm' needs Transformer Engine with CUDA (Megatron-Core "
                                                      "0.16 recomputes norms through Transformer Engine's FP8 state), "
                                                      "not available here; use 'core_attn' or 'mlp'")
    if "shared_experts" in chosen and section.get("moe_shared_expert_overlap") and \
            (getattr(hf_config, "shared_expert_intermediate_size", None) or getattr(hf_config, "n_shared_experts", None)):
        raise ConfigError(f"{KEY}.recompute_modules", "'shared_experts' cannot be recomputed with "
                                                      "moe_shared_expert_overlap (Megatron-Core refuses it); set one "
                                                      "of them off")


def keep_gradients_through_recompute(model: Any) -> Any:
    """Megatron-Core's recompute checkpoints reentrantly: a checkpointed part's output needs grad only
    when its input does, so behind frozen weights (LoRA freezes the embedding and every base layer)
    no gradient reaches the adapters inside it, and full recompute's backward fails ("element 0 of
    tensors does not require grad"). The embedding's output is made a leaf that requires grad while
    training; nothing changes for a trainable embedding. Returns the hook's handle (None: no embedding
    on this pipeline stage)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return None
    import torch

    def hook(module: Any, args: Any, output: Any) -> Any:
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_()
        return None

    return embedding.register_forward_hook(hook)


def recompute_kwargs(section: Mapping[str, Any] | None, hf_config: Any = None, *,
                     transformer_engine: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` fields for the section's recompute keys, checked (:func:`check_recompute`)."""
    section = section or {}
    check_recompute(section, hf_config, transformer_engine=transformer_engine)
    if not section.get("activation_checkpointing"):
        return dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    if (section.get("recompute_granularity") or "full") == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None,
                recompute_modules=_modules(section))


def release_storage(params: Iterable[torch.Tensor]) -> None:
    """Free each parameter's storage ahead of DDP's contiguous buffer, which would copy it: the
    parameter keeps its shape, dtype and device over one element with zero strides (a tensor of
    its own, not a view, as DDP requires), and the checkpoint is loaded into the buffer after."""
    on_gpu = False
    for param in params:
        one = torch.empty(1, dtype=param.dtype, device=param.device)
        stand_in = torch.empty(0, dtype=param.dtype, device=param.device)
        stand_in.set_(one.untyped_storage(), 0, param.shape, (0,) * param.dim())
        param.data = stand_in
        on_gpu = on_gpu or param.device.type == "cuda"
    if on_gpu:  # the freed blocks are many and small, the buffer one: give them back to the driver
        torch.cuda.empty_cache()
    trim_host_heap()  # and, on the host, the freed pages that glibc would keep
