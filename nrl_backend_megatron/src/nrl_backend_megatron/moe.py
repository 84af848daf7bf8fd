"""Mixture-of-experts settings: the ``moe_*`` keys of ``policy.megatron_cfg`` and the HF config,
turned into Megatron-Core ``TransformerConfig`` fields, checked for this machine.

What comes from where:

* the model's shape (experts, their width, top-k, shared expert, which layers are sparse) from the
  HF config, so the Megatron model computes what the HF model computes: HF's Qwen3-MoE softmaxes
  over all experts, takes the top k and renormalises them, which is Megatron's default top-k
  routing (softmax over the top-k logits); Qwen2-MoE does not renormalise, which is Megatron's
  ``moe_router_pre_softmax``; Qwen2-MoE's shared expert has a sigmoid gate
  (``moe_shared_expert_gate``); gpt-oss softmaxes over its top-k biased logits, which is the
  renormalised case;
* how it trains (expert parallelism, load-balancing loss, router dtype, token dispatcher, fusions)
  from NeMo RL's keys. ``moe_router_topk`` (nrl's key) overrides the model's top-k for training only.

The experts are always Megatron's ``SequentialMLP`` (``moe_grouped_gemm`` off): one ``linear_fc1``
/ ``linear_fc2`` pair per expert under names the converter maps one to one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nrl_backend_megatron.convert.families import (
    expert_width,
    family_of,
    moe_layers,
    num_experts,
    shared_expert_width,
)
from nrl_core.api import ConfigError

logger = logging.getLogger(__name__)

KEY = "policy.megatron_cfg"
DISPATCHERS = ("allgather", "alltoall", "flex")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def is_moe(hf_config: Any) -> bool:
    return num_experts(hf_config) > 0


def renormalises_top_k(hf_config: Any) -> bool:
    """Whether the model's top-k routing weights sum to one: HF's ``norm_topk_prob``, or gpt-oss's
    softmax over the top-k logits (the same weights)."""
    return bool(getattr(hf_config, "norm_topk_prob", False)) or family_of(hf_config).gpt_oss


def token_dispatcher(section: Mapping[str, Any], on_gpu: bool) -> str:
    """The dispatcher to use: the configured one, or by default ``alltoall`` with CUDA and
    ``allgather`` without (the only one that runs on CPU: ``alltoall`` creates a CUDA stream)."""
    chosen = section.get("moe_token_dispatcher_type")
    if chosen is None:
        return "alltoall" if on_gpu else "allgather"
    if chosen not in DISPATCHERS:
        raise ConfigError(f"{KEY}.moe_token_dispatcher_type", f"must be one of {', '.join(DISPATCHERS)}, got {chosen!r}")
    if not on_gpu and chosen != "allgather":
        raise ConfigError(f"{KEY}.moe_token_dispatcher_type",
                          f"'{chosen}' needs CUDA (its dispatcher uses CUDA streams); set it to allgather on this machine")
    return str(chosen)


def check_moe_section(section: Mapping[str, Any], hf_config: Any, on_gpu: bool) -> None:
    """One-line errors for MoE settings this model or machine cannot honour (before any group exists)."""
    ep = int(section.get("expert_model_parallel_size") or 1)
    etp = int(section.get("expert_tensor_parallel_size") or 1)
    if not is_moe(hf_config):
        if ep != 1:
            raise ConfigError(f"{KEY}.expert_model_parallel_size",
                              f"{ep} needs a mixture-of-experts model; {family_of(hf_config).architecture} has no "
                              "experts, set it to 1")
        return
    experts = num_experts(hf_config)
    if section.get("moe_shared_expert_overlap") and getattr(hf_config, "moe_latent_size", None):
        raise ConfigError(f"{KEY}.moe_shared_expert_overlap", "Megatron-Core does not overlap the shared expert with "
                                                              "experts in a latent space (moe_latent_size); set it false")
    if ep < 1 or experts % ep:
        raise ConfigError(f"{KEY}.expert_model_parallel_size", f"{ep} does not divide the model's {experts} experts")
    tp = int(section.get("tensor_model_parallel_size") or 1)
    if tp > 1 and not section.get("sequence_parallel"):
        raise ConfigError(f"{KEY}.sequence_parallel", f"a mixture-of-experts model at tensor_model_parallel_size {tp} "
                                                      "needs sequence_parallel: true (Megatron-Core refuses MoE with "
                                                      "tensor parallelism alone)")
    if etp != 1:
        raise ConfigError(f"{KEY}.expert_tensor_parallel_size",
                          f"{etp} is not supported (experts are not tensor-parallel in nrl's Megatron backend); set 1")
    dispatcher = token_dispatcher(section, on_gpu)
    if section.get("moe_shared_expert_overlap") and dispatcher != "alltoall":
        raise ConfigError(f"{KEY}.moe_shared_expert_overlap",
                          f"needs the alltoall token dispatcher (this run uses {dispatcher}); set it to false")
    if section.get("moe_enable_deepep") and not on_gpu:
        raise ConfigError(f"{KEY}.moe_enable_deepep", "DeepEP needs CUDA; set it to false on this machine")
    balancing = section.get("moe_router_load_balancing_type") or "none"
    if balancing not in LOAD_BALANCING:
        raise ConfigError(f"{KEY}.moe_router_load_balancing_type",
                          f"must be one of {', '.join(LOAD_BALANCING)}, got {balancing!r}")
    topk = int(section.get("moe_router_topk") or hf_config.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise ConfigError(f"{KEY}.moe_router_topk", f"must be between 1 and the model's {experts} experts, got {topk}")
    if topk == 1 and renormalises_top_k(hf_config):
        raise ConfigError(f"{KEY}.moe_router_topk", "top-1 routing of a model that renormalises its top-k "
                          "probabilities (norm_topk_prob) weights every expert output by 1, which Megatron-Core "
                          "cannot express; use 2 or more")


def moe_config_kwargs(hf_config: Any, section: Mapping[str, Any], on_gpu: bool) -> dict[str, Any]:
    """``TransformerConfig`` fields for a MoE model (empty for a dense one)."""
    if not is_moe(hf_config):
        return {}
    check_moe_section(section, hf_config, on_gpu)
    family = family_of(hf_config)
    topk = int(section.get("moe_router_topk") or hf_config.num_experts_per_tok)
    if topk != int(hf_config.num_experts_per_tok):
        logger.warning("%s.moe_router_topk=%d differs from the model's num_experts_per_tok=%d: the policy trains "
                       "with top-%d routing while generation engines built from the checkpoint route to %d experts",
                       KEY, topk, hf_config.num_experts_per_tok, topk, hf_config.num_experts_per_tok)
    kwargs: dict[str, Any] = dict(
        num_moe_experts=num_experts(hf_config), moe_ffn_hidden_size=expert_width(hf_config),
        moe_router_topk=topk, moe_router_score_function="softmax",
        moe_router_pre_softmax=not renormalises_top_k(hf_config),
        moe_layer_freq=[1 if sparse else 0 for sparse in moe_layers(hf_config)],
        moe_grouped_gemm=False, moe_token_dispatcher_type=token_dispatcher(section, on_gpu),
        moe_router_load_balancing_type=section.get("moe_router_load_balancing_type") or "none",
        moe_aux_loss_coeff=float(section.get("moe_aux_loss_coeff") or 0.0),
        moe_router_dtype=section.get("moe_router_dtype"),
        moe_router_bias_update_rate=float(section.get("moe_router_bias_update_rate") or 0.0),
        moe_permute_fusion=bool(section.get("moe_permute_fusion")) and on_gpu,
        moe_enable_deepep=bool(section.get("moe_enable_deepep")),
        moe_shared_expert_overlap=bool(section.get("moe_shared_expert_overlap")),
        moe_per_layer_logging=bool(section.get("moe_per_layer_logging")),
    )
    if family.latent or family.hybrid:  # Nemotron 3 routes as DeepSeek-V3 does
        kwargs.update(latent_routing(hf_config, topk))
        # HF's and vLLM's DeepSeek-V3 and Nemotron 3 score the router in float32; bf16 would route otherwise
        kwargs["moe_router_dtype"] = section.get("moe_router_dtype") or "fp32"
    elif family.shared_expert:
        kwargs.update(moe_shared_expert_intermediate_size=int(hf_config.shared_expert_intermediate_size),
                      moe_shared_expert_gate=True)
    return kwargs


def latent_routing(hf_config: Any, topk: int) -> dict[str, Any]:
    """DeepSeek-V3's routing in Megatron's terms: sigmoid scores; experts chosen on the scores plus a
    correction bias (a buffer nrl leaves as trained unless ``moe_router_bias_update_rate`` says
    otherwise) but weighted by the scores alone, renormalised over the top-k and scaled by
    ``routed_scaling_factor``; top-k within the best ``topk_group`` of ``n_group`` groups."""
    if not bool(getattr(hf_config, "norm_topk_prob", True)) and topk > 1:
        raise ConfigError("policy.model_name", "this DeepSeek-V3 model does not renormalise its top-k routing "
                                               "weights (norm_topk_prob: false), which Megatron's sigmoid router "
                                               "always does; not supported by the Megatron backend")
    groups, group_topk = int(getattr(hf_config, "n_group", 1) or 1), int(getattr(hf_config, "topk_group", 1) or 1)
    kwargs: dict[str, Any] = dict(
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0))
    if groups > 1:
        # Megatron ranks a group by its best topk // group_topk scores, HF by its best two
        if topk // group_topk != 2:
            raise ConfigError("policy.model_name", f"group-limited routing with num_experts_per_tok {topk} and "
                                                   f"topk_group {group_topk} ranks groups differently in Megatron "
                                                   "(by the best top-k // topk_group scores, HF by the best two); "
                                                   "not supported by the Megatron backend")
        kwargs.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    width = shared_expert_width(hf_config)
    if width:
        kwargs.update(moe_shared_expert_intermediate_size=width, moe_shared_expert_gate=False)
    return kwargs


def mark_experts_parallel(model: Any) -> None:
    """Give routed experts Megatron's expert-parallel treatment at every expert-parallel size,
    including 1 (where Megatron would fold them into the dense parameters).

    Why: the optimizer then always consists of a dense and an expert optimizer, so its checkpoint
    has the same structure whatever ``expert_model_parallel_size`` saved it, and a checkpoint saved
    with expert parallelism 2 resumes at 1 (expert state is sharded by global expert index). At
    size 1 the experts' gradients are averaged over the same ranks as before. Run before DDP.
    """
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def freeze_router(model: Any) -> int:
    """``freeze_moe_router``: the routers' weights stop training. Returns how
    many parameters were frozen. Must run before DDP wraps the model (DDP skips frozen params)."""
    frozen = 0
    for name, param in model.named_parameters():
        if ".mlp.router." in name:
            param.requires_grad_(False)
            frozen += 1
    return frozen


_AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                   "global_aux_loss": "global_load_balancing_loss"}


class RouterMetrics:
    """The routers' load-balance metrics (:mod:`nrl_core.moe`) and Megatron's own load-balancing
    losses, for one training step.

    Forward hooks on every ``TopKRouter`` feed :class:`nrl_core.moe.RouterStats` while the worker
    records a training micro-batch (``stats.recording(mask)``, ``mask`` ``[b, S]``); Megatron hands
    routers tokens in ``[S, b]`` order (``[S/tp, b]`` under sequence parallelism).
    """

    def __init__(self, model: Any, tconfig: Any, *, tp_rank: int, tp_size: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from nrl_core.api import RouterStats

        self.tconfig = tconfig
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.stats = RouterStats(tconfig.num_layers, tconfig.num_moe_experts, tconfig.moe_router_topk)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: tuple, output: tuple) -> None:
        import torch

        if not self.stats.active:
            return
        hidden = args[0]
        logits = torch.nn.functional.linear(hidden.detach().reshape(-1, hidden.shape[-1]).float(),
                                            module.weight.detach().float())
        valid = self.stats.valid
        if valid is not None:
            valid = valid.transpose(0, 1)  # [S, b], the order Megatron flattens tokens in
            if valid.shape[0] != hidden.shape[0]:  # sequence parallel: this rank's slice of the sequence
                valid = valid.chunk(self.tp_size, 0)[self.tp_rank]
            valid = valid.reshape(-1)
        self.stats.add(module.layer_number - 1, logits, output[1], valid)

    def reset(self) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.stats.reset()
        clear_aux_losses_tracker()

    def collect(self, num_microbatches: int, dp_size: int) -> dict[str, float]:
        """The step's metrics, identical on every rank. Collective over the whole world."""
        import torch
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        from nrl_core.api import all_reduce, balance_metrics

        cfg = self.tconfig
        layers = cfg.num_layers
        names = [_AUX_LOSS_NAMES[cfg.moe_router_load_balancing_type]] \
            if cfg.moe_router_load_balancing_type in _AUX_LOSS_NAMES and cfg.moe_aux_loss_coeff > 0 else []
        tracker = get_moe_layer_wise_logging_tracker()
        aux = [tracker[n]["values"].detach().double().cpu() if n in tracker else torch.zeros(layers, dtype=torch.float64)
               for n in names]
        # one collective: routers' statistics (every tensor-parallel rank routes the same tokens
        # unless the sequence is split over them) and the aux losses (partial sums over TP/CP
        # ranks, disjoint layers over PP, one value per data-parallel rank to be averaged)
        flat = torch.cat([self.stats.totals().reshape(-1)] + aux)
        all_reduce(flat)
        n_stats = self.stats.totals().numel()
        duplicates = 1 if cfg.sequence_parallel else self.tp_size
        totals = flat[:n_stats].reshape(layers, -1) / duplicates
        metrics = balance_metrics(totals, cfg.num_moe_experts, cfg.moe_router_topk)
        sparse = [i for i, flag in enumerate(cfg.moe_layer_freq) if flag]
        for k, name in enumerate(names):
            values = flat[n_stats + k * layers: n_stats + (k + 1) * layers] / (dp_size * num_microbatches)
            metrics[f"moe/{name}"] = float(values[sparse].mean())
            if cfg.moe_per_layer_logging:
                metrics.update({f"moe/{name}_layer_{i}": float(values[i]) for i in sparse})
        return metrics
