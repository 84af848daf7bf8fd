"""Megatron-Core optimizer and learning-rate schedule from ``policy.megatron_cfg``, and the step.

Why a step function of our own: Megatron-Core's fp32 gradient clipping asserts CUDA tensors
(``clip_grads.clip_grad_by_total_norm_fp32``). Without CUDA, Megatron's optimizer is built with
``clip_grad=0`` and :func:`optimizer_step` clips itself: the global L2 norm over the gradients
Megatron says count for the norm (no tensor-parallel duplicates, shared embeddings once), summed
over Megatron's grad-stats group (model-parallel; the whole world for the distributed optimizer),
then Megatron's own ``step_with_ready_grads``. On a GPU it is just ``optimizer.step()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nrl_backend_megatron.checks import KEY, check_optimizer_section
from nrl_backend_megatron.model import transformer_engine_installed
from nrl_core.api import ConfigError, all_reduce


@dataclass
class OptimizerBundle:
    optimizer: Any
    scheduler: Any
    clip_grad: float
    own_clipping: bool


def build_optimizer(models: list[Any], section: Mapping[str, Any], precision: str) -> OptimizerBundle:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    check_optimizer_section(section)
    opt = section["optimizer"]
    sched = section["scheduler"]
    bf16 = bool(opt["bf16"]) or precision == "bfloat16"
    fp16 = bool(opt["fp16"]) or precision == "float16"
    own_clipping = not torch.cuda.is_available()
    clip = float(opt["clip_grad"] or 0.0)  # null: no clipping, as in NeMo RL
    if (bf16 or fp16) and not torch.cuda.is_available():
        raise ConfigError(f"{KEY}.optimizer.{'bf16' if bf16 else 'fp16'}",
                          "Megatron's mixed-precision optimizer keeps CUDA tensors; on a machine without GPUs train "
                          "in float32 (policy.precision: float32 and megatron_cfg.optimizer.bf16/fp16: false)")
    if opt["use_precision_aware_optimizer"] and not transformer_engine_installed():
        raise ConfigError(f"{KEY}.optimizer.use_precision_aware_optimizer",
                          "needs Transformer Engine's FusedAdam, which is not installed (it needs CUDA); set it to false")
    config = OptimizerConfig(
        optimizer=opt["optimizer"], lr=opt["lr"], min_lr=opt["min_lr"], weight_decay=opt["weight_decay"],
        bf16=bf16, fp16=fp16, params_dtype=getattr(torch, opt["params_dtype"]),
        adam_beta1=opt["adam_beta1"], adam_beta2=opt["adam_beta2"], adam_eps=opt["adam_eps"],
        sgd_momentum=opt["sgd_momentum"], use_distributed_optimizer=opt["use_distributed_optimizer"],
        use_precision_aware_optimizer=opt["use_precision_aware_optimizer"],
        clip_grad=0.0 if own_clipping else clip,
    )
    optimizer = get_megatron_optimizer(config, models)
    style = sched["lr_decay_style"]
    warmup = int(sched["lr_warmup_iters"])
    decay_iters = warmup + 1 if sched["lr_decay_iters"] is None else sched["lr_decay_iters"]
    wd = opt["weight_decay"]
    start_wd = wd if sched["start_weight_decay"] is None else sched["start_weight_decay"]
    end_wd = wd if sched["end_weight_decay"] is None else sched["end_weight_decay"]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=sched["lr_warmup_init"], max_lr=opt["lr"], min_lr=opt["min_lr"],
        lr_warmup_steps=warmup, lr_decay_steps=max(int(decay_iters), 1), lr_decay_style=style,
        start_wd=start_wd, end_wd=end_wd, wd_incr_steps=max(int(decay_iters), 1),
        wd_incr_style=sched["weight_decay_incr_style"],
    )
    return OptimizerBundle(optimizer, scheduler, clip, own_clipping)


def main_params(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 main copies Megatron's mixed-precision optimizers keep of bf16/fp16 parameters (its
    own, or the distributed optimizer's shards): standalone tensors that neither the parameter nor
    the gradient buffers hold, so offload must move them itself. Empty for an fp32 model (CPU)."""
    out = []
    for leaf in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for attr in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            out.extend(p for group in getattr(leaf, attr, None) or [] for p in group if p is not None)
    return out


def fresh_optimizer(bundle: OptimizerBundle) -> None:
    """Start ``bundle``'s optimizer and schedule afresh after the weights were loaded without them
    (Megatron-LM's resume with ``load_optim`` off): no optimizer state (each leaf's torch optimizer
    builds its moments and step again at the next step; with the precision-aware optimizer that
    includes the main weights, taken from the loaded parameters), main weights copied from the
    loaded parameters (``reload_model_params``), the schedule back at step 0."""
    for leaf in _leaf_optimizers(bundle.optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is not None and hasattr(inner, "state"):
            inner.state.clear()
    bundle.optimizer.reload_model_params()
    bundle.scheduler.num_steps = 0
    bundle.scheduler.step(increment=0)


def ready_to_load(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet the zero Adam state Megatron's own
    ``init_state_fn`` gives, with a step. Why: where Adam is torch's own (no Transformer Engine
    or Apex, as on the CPU), Megatron reads the step from that state while it builds the state a
    checkpoint loads into, and a fresh torch Adam has none."""
    for leaf in _leaf_optimizers(optimizer):
        inner, init = getattr(leaf, "optimizer", None), getattr(leaf, "init_state_fn", None)
        if inner is None or init is None or not hasattr(leaf, "gbuf_ranges"):  # not the distributed optimizer
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if all(inner.state.get(p) for p in params):
            continue
        init(inner, leaf.config)
        for param in params:
            inner.state[param].setdefault("step", torch.tensor(0.0))


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Load Megatron's optimizer ``state``, then give each parameter its own Adam step from the
    loaded param groups. Why: where Adam is torch's own (no Transformer Engine or Apex, as on the
    CPU), the distributed optimizer's load leaves one step tensor shared by every parameter, with
    the live value copied back over the loaded one; a shared step would also advance once per
    parameter at the next update."""
    with torch.no_grad():  # the distributed optimizer's fp32 main weights are views of the parameters
        optimizer.load_state_dict(state)
    for leaf in _leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", leaf)
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                own = inner.state.get(param)
                if own and torch.is_tensor(own.get("step")):
                    own["step"] = torch.tensor(float(group["step"]), dtype=own["step"].dtype,
                                               device=own["step"].device)


def _leaf_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def global_grad_norm(optimizer: Any) -> float:
    """L2 norm of the whole model's gradient: each leaf optimizer's squared norm reduced over its
    own grad-stats group (the experts' group spans the expert-parallel ranks), then summed."""
    total = 0.0
    for leaf in _leaf_optimizers(optimizer):
        grads = leaf.get_main_grads_for_grad_norm()
        squares = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else "cpu")
        for g in grads:
            squares += g.detach().double().pow(2).sum()
        if dist.is_initialized():
            all_reduce(squares, group=leaf.get_grad_stats_parallel_group())
        total += float(squares)
    return math.sqrt(total)


@torch.no_grad()
def clip_grads_(optimizer: Any, max_norm: float, total_norm: float) -> None:
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff >= 1.0:
        return
    for leaf in _leaf_optimizers(optimizer):
        for param in leaf.get_parameters():
            grad = param.decoupled_grad if getattr(param, "decoupled_grad", None) is not None else param.grad
            if grad is not None:
                grad.mul_(coeff)


def optimizer_step(bundle: OptimizerBundle, guard: Callable[[float | None], None] | None = None) -> tuple[bool, float | None]:
    """One optimizer step; returns (whether it updated, the pre-clip gradient norm).

    ``guard(norm)`` runs after the gradients are ready and their norm is known, before anything
    is clipped or stepped; it raises to stop the step (the divergence guard). With a guard the
    GPU path takes Megatron's ``step()`` apart the way ``ChainedOptimizer.step`` does.
    """
    optimizer = bundle.optimizer
    if not bundle.own_clipping and guard is None:
        ok, norm, _ = optimizer.step()
        return bool(ok), norm
    if optimizer.prepare_grads():  # found inf/nan (mixed precision loss scaling): Megatron skips the step
        return False, None
    if bundle.own_clipping:
        norm = global_grad_norm(optimizer)
        if guard is not None:
            guard(norm)
        if bundle.clip_grad > 0.0 and math.isfinite(norm):
            clip_grads_(optimizer, bundle.clip_grad, norm)
    else:
        norm = float(optimizer.get_grad_norm())
        guard(norm)
        _megatron_clip(optimizer, norm)
    ok = optimizer.step_with_ready_grads()
    return bool(ok), norm


def _megatron_clip(optimizer: Any, norm: float) -> None:
    """Megatron's own clipping by a known total norm (CUDA tensors), leaf by leaf."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for leaf in _leaf_optimizers(optimizer):
        if getattr(leaf, "is_stub_optimizer", False) or leaf.config.clip_grad <= 0.0:
            continue
        params = leaf.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm=leaf.config.clip_grad, total_norm=norm,
                                         use_decoupled_grad=leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
