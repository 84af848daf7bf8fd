"""Transformer Engine's FusedAdam update, for machines without Transformer Engine.

NeMo RL's Automodel recipes name TE's fused AdamW with fp32 master weights and bfloat16 moments.
Where TE is not installed (the CPU, a login node, a twin) the same update runs here in plain torch
ops on the recipe's own arguments, so the recipe checks and trains with the optimizer it names
rather than a silent substitute; where TE is installed, TE's own class is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

TE_FUSED_ADAM = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


class FusedAdam(torch.optim.Optimizer):
    """Adam or AdamW with TE's arguments: moments kept in their own dtypes, an optional master copy.

    Each step reads the moments and the master weights in float32, updates them there, and stores
    them back in their dtypes, as TE's kernel does. ``store_param_remainders`` is TE's way of
    keeping an fp32 master copy of bfloat16 weights in two extra bytes; its values are those of an
    fp32 master copy, which is what is kept here (TE ignores it without master weights, as here).
    Float16 and FP8 moments need the per-tensor scaling of TE's kernels and are refused. The
    optimizer state is laid out as torch's Adam lays it out, not as TE's: a checkpoint written with
    one resumes only with the same one.
    """

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, bias_correction: bool = True,
                 adam_w_mode: bool = True, capturable: bool = False, master_weights: bool = False,
                 master_weight_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: bool | None = None) -> None:
        del capturable, set_grad_none  # CUDA-graph capture and grad clearing: no effect on the update
        if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas: give two coefficients in [0, 1), got {list(betas)}")
        if amsgrad:
            raise ValueError("amsgrad: TE's FusedAdam has no AMSGrad variant; set amsgrad: false")
        if use_decoupled_grad:
            raise ValueError("use_decoupled_grad: reads Megatron's param.decoupled_grad, which this backend "
                             "does not set; set use_decoupled_grad: false")
        del store_param_remainders  # the values of an fp32 master copy, kept as one (class docstring)
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in MOMENT_DTYPES:
                raise ValueError(f"{name}: {dtype} moments need Transformer Engine's per-tensor scaling, which "
                                 "its kernels do on GPUs; use torch.bfloat16 or torch.float32")
        if master_weights and master_weight_dtype != torch.float32:
            raise ValueError(f"master_weight_dtype: master weights are float32 in TE's FusedAdam, got "
                             f"{master_weight_dtype}; use torch.float32")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "adam_w_mode": adam_w_mode}
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, dtype=self.exp_avg_dtype)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.exp_avg_sq_dtype)
        if self.master_weights:
            state["master_param"] = param.detach().to(self.master_weight_dtype, copy=True)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader casts each state tensor to its parameter's dtype, which would round an fp32
        master copy of bfloat16 weights; the stored values are put back in their own dtypes."""
        saved = state_dict["state"]
        ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        super().load_state_dict(state_dict)
        dtypes = {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype,
                  "master_param": self.master_weight_dtype}
        for index, param in zip(ids, params):
            for key, dtype in dtypes.items():
                value = saved.get(index, {}).get(key)
                if value is not None:
                    self.state[param][key] = value.to(dtype=dtype, device=param.device, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param] or self._init_state(param)
                state["step"] += 1
                step = float(state["step"])
                master = state.get("master_param")
                weights = (master if master is not None else param).float()
                grad = param.grad.float()
                if decay and not group["adam_w_mode"]:
                    grad = grad.add(weights, alpha=decay)
                exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                correction1 = 1 - beta1**step if group["bias_correction"] else 1.0
                correction2 = 1 - beta2**step if group["bias_correction"] else 1.0
                update = (exp_avg / correction1).div_((exp_avg_sq / correction2).sqrt_().add_(eps))
                if decay and group["adam_w_mode"]:
                    update.add_(weights, alpha=decay)
                weights.add_(update, alpha=-lr)
                _store(state["exp_avg"], exp_avg)
                _store(state["exp_avg_sq"], exp_avg_sq)
                if master is not None:
                    _store(master, weights)
                _store(param, weights)
        return loss


def _store(target: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` back into ``target``'s dtype unless it is ``target`` itself (already in place)."""
    if value is not target:
        target.copy_(value)
